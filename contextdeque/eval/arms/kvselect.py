"""KV selection arms: MM-ShiftKV, SnapKV and StreamingLLM at a per-head budget.

Prefill-only selection (the protocol of all three papers): the prompt — root, chunks and the
request's query — is prefilled, then ``budget`` rows per layer and KV head are kept for decoding
(see :mod:`contextdeque.window.kvselect`). ``base`` says where the chunks' KV comes from:
``"reprefill"`` (default: one forward over root + chunks + query, the papers' setting and the
"full KV" the selection is judged against) or any other registered arm (e.g. ``"patch"``), whose
KV gets the query prefilled on top (the query's tokens are then the only prefilled ones, so they
alone give MM-ShiftKV's hidden-state statistics and SnapKV's observation queries).

The result's ``kv`` holds the kept rows of ``[root, chunks, query]`` (per layer ``[H, C, d]``)
and ``next_position`` is the first position after the query; :class:`SelectionResult` also
carries the trace (full prompt KV) and the selection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.errors import ReuseArmError
from ...core.kv import kv_nbytes
from ...window.kvselect import KVSelector, PrefillTrace, QueryModel, Selection, check_budget, make_selector, traced_prefill
from .base import ArmResult, ReuseArm, ReuseRequest, make_arm


@dataclass
class SelectionResult(ArmResult):
    """An :class:`ArmResult` whose ``kv`` is the kept rows; ``trace`` holds the full prompt KV
    (``trace.kv``, per layer ``[H, S, d]``) and ``selection`` the kept row indices."""

    trace: PrefillTrace | None = field(default=None, repr=False)
    selection: Selection | None = field(default=None, repr=False)


def full_prompt_trace(request: ReuseRequest) -> PrefillTrace:
    """One traced forward over root + chunks + query (the full-KV prefill)."""
    be = request.backend
    if not request.query_ids:
        raise ReuseArmError("KV selection arms need the request's query_ids (selection happens after the query's prefill)")
    q = torch.as_tensor(list(request.query_ids), dtype=torch.long)
    R = request.root_len
    root = torch.tensor(be.root_ids, dtype=torch.long)
    pos = torch.cat([be.text_positions(0, R), request.positions(), be.text_positions(request.next_position, q.numel())], 1)
    if request.all_text:
        return traced_prefill(be, input_ids=torch.cat([root, request.token_ids(), q]), positions=pos)
    emb = torch.cat([be.embed_tokens(root).to("cpu", torch.float32), request.inputs()["inputs_embeds"],
                     be.embed_tokens(q).to("cpu", torch.float32)])
    return traced_prefill(be, inputs_embeds=emb, positions=pos)


def query_trace(request: ReuseRequest, kv: list[Any]) -> PrefillTrace:
    """The query prefilled (traced) over an arm's assembled ``kv`` of root + chunks."""
    be = request.backend
    if not request.query_ids:
        raise ReuseArmError("KV selection arms need the request's query_ids (selection happens after the query's prefill)")
    q = torch.as_tensor(list(request.query_ids), dtype=torch.long)
    return traced_prefill(be, input_ids=q, positions=be.text_positions(request.next_position, q.numel()), past=kv)


class KVSelectArm(ReuseArm):
    """Base of the selection arms: ``budget`` rows per KV head (int >= 1) selected by the
    registered selector ``selector`` over the KV of ``base`` (an arm name; default re-prefill)."""

    selector: str = ""

    def __init__(self, budget: int = 256, *, base: str = "reprefill", label: str | None = None,
                 **selector_options: Any) -> None:
        self.budget = check_budget(budget)
        super().__init__(label=label or f"{self.name}-{self.budget}")
        self.base = base
        self.selector_options = selector_options
        self._selector: KVSelector = make_selector(self.selector, **selector_options)

    def trace(self, request: ReuseRequest) -> tuple[PrefillTrace, int, int]:
        """The prefilled prompt and the serve-time forwards / tokens it took."""
        if self.base == "reprefill":
            tr = full_prompt_trace(request)
            return tr, 1, tr.n_prefilled
        base = make_arm(self.base).run(request)
        tr = query_trace(request, base.kv)
        return tr, base.report.forwards + 1, base.report.tokens_prefilled + tr.n_prefilled

    def run(self, request: ReuseRequest) -> SelectionResult:
        tr, forwards, tokens = self.trace(request)
        sel = self._selector.select(tr, self.budget, QueryModel(request.backend))
        rep = self.new_report(request)
        rep.forwards, rep.tokens_prefilled = forwards, tokens
        rep.bytes_canonical = request.page_bytes if self.base != "reprefill" else 0
        full = kv_nbytes(tr.kv)
        rep.extras.update({"budget": self.budget, "rows": tr.n_rows, "kept_rows": sel.kept,
                           "kv_bytes_full": full, "kv_bytes_kept": sel.kept_bytes(tr.kv), "base": self.base})
        return SelectionResult(kv=sel.gather(tr.kv), next_position=tr.next_position, report=rep, trace=tr, selection=sel)


class MMShiftKVArm(KVSelectArm):
    """MM-ShiftKV (variance-expanded query proxies, group votes, last-query anchor)."""

    name = "mm-shiftkv"
    selector = "mm-shiftkv"


class SnapKVArm(KVSelectArm):
    """SnapKV (observation-window attention, pooled)."""

    name = "snapkv"
    selector = "snapkv"


class StreamingLLMArm(KVSelectArm):
    """StreamingLLM (attention sinks + recent rows)."""

    name = "streamingllm"
    selector = "streamingllm"
