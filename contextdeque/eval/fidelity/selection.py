"""The fidelity harness's ``select`` group: KV selection judged against full KV.

Per item, the prompt (root, chunks, query) is prefilled once with full KV (traced) and the full-KV
greedy answer ``y_1 .. y_k`` (k = the item's decode length) is taken as the teacher-forced
continuation. Every selector at every per-head budget keeps its rows; then, feeding ``y`` over the
kept rows and over the full KV:

- ``kl``: mean over the k steps of next-token KL(full KV ‖ selected KV) (``y_1`` itself comes
  from the full prefill in every arm, so the first answer token never differs);
- ``coverage``: share of the full-KV decode queries' attention mass on prompt rows that falls on
  the kept rows (mean over layers, query heads and steps: MM-ShiftKV's figure 1b);
- ``decision``: ``y_1`` then the selected KV's argmax at each teacher-forced step (agreement =
  it equals the full-KV answer).

Composition with the patch (when the main group formed patches): MM-ShiftKV over the
``patch-r{matched_rank}`` window (no full prefill: the query is the only prefilled text, so it
alone gives the hidden-state statistics), judged against the same full-KV continuation, beside
that window with no selection.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

import torch

from ...core.metrics import kl_divergence
from ...window.kvselect import PrefillTrace, QueryModel, Selection, attention_coverage, make_selector, traced_prefill
from ..arms import PatchArm, ReuseRequest
from ..arms.kvselect import full_prompt_trace, query_trace
from .harness import ArmScore, Sample


def _continuation(backend: Any, trace: PrefillTrace, n_decode: int) -> list[int]:
    """The full-KV greedy answer (at most ``n_decode`` tokens, stopping after EOS)."""
    eos = getattr(backend.tokenizer, "eos_token_id", None) if backend.tokenizer is not None else None
    assert trace.logits is not None
    y = [int(torch.argmax(trace.logits))]
    kv = trace.kv
    pos = trace.next_position
    while len(y) < n_decode and (eos is None or y[-1] != eos):
        res = backend.forward(input_ids=[y[-1]], positions=backend.text_positions(pos, 1), past=kv)
        kv = [(torch.cat([a, k.to(a.dtype)], 1), torch.cat([b, v.to(b.dtype)], 1)) for (a, b), (k, v) in zip(kv, res.kv)]
        pos += 1
        y.append(int(torch.argmax(res.logits[-1])))
    return y


def _judge(backend: Any, y: list[int], start: int, kv: Sequence[Any], full_logits: torch.Tensor) -> tuple[float, tuple[int, ...], list[float]]:
    lg = backend.forward(input_ids=y, positions=backend.text_positions(start, len(y)), past=list(kv), logits="all").logits
    kls = [kl_divergence(full_logits[i], lg[i]) for i in range(len(y))]
    decision = (y[0], *(int(torch.argmax(lg[i])) for i in range(len(y) - 1)))
    return statistics.fmean(kls), decision, kls


def selection_samples(mat: Any, cfg: Any, n_decode: int, patches: dict[int, list[Any]] | None = None) -> list[Sample]:
    """The ``select`` group's one sample for item ``mat`` (see the module docstring)."""
    be = mat.meta["backend"]
    req = ReuseRequest(be, mat.chunks, query_ids=mat.query_ids)
    tr = full_prompt_trace(req)
    qm = QueryModel(be)
    y = _continuation(be, tr, n_decode)
    dec = traced_prefill(be, input_ids=y, positions=be.text_positions(tr.next_position, len(y)), past=tr.kv, logits="all")
    full_logits = dec.logits
    ref = tuple(y)
    arms: dict[str, Any] = {}

    def add(name: str, kv: Sequence[Any], sel: Selection | None, rows: int, extra: dict[str, Any] | None = None) -> None:
        kl, decision, kls = _judge(be, y, tr.next_position, kv, full_logits)
        rep: dict[str, Any] = {"kl_steps": kls, "rows": rows, **(extra or {})}
        if sel is not None:
            rep["coverage"] = attention_coverage(qm, dec, tr.n_rows, sel)
            rep["kept_rows"] = sel.kept
            rep["kept_fraction"] = sel.kept / rows
        arms[name] = ArmScore(kl=kl, decision=decision, report=rep)

    for method in cfg.select_methods:
        for budget, sel in make_selector(method).select_many(tr, list(cfg.select_budgets), qm).items():
            add(f"{method}-{budget}", sel.gather(tr.kv), sel, tr.n_rows)
    if cfg.select_on_patch and patches:
        pkv = PatchArm(cfg.matched_rank).run(req.with_patches(patches)).kv
        ptr = query_trace(req, pkv)
        add(f"patch-r{cfg.matched_rank}+allrows", ptr.kv, None, ptr.n_rows, {"kept_fraction": 1.0})
        for budget, sel in make_selector("mm-shiftkv").select_many(ptr, list(cfg.select_budgets), qm).items():
            add(f"mm-shiftkv-{budget}+patch-r{cfg.matched_rank}", sel.gather(ptr.kv), sel, ptr.n_rows)
    return [Sample(item=mat.item.id, family=mat.item.family, group="select", ref_decision=ref, blind_kl=0.0,
                       blind_decision=ref, arms=arms, answer_ids=tuple(mat.answer_ids),
                       detail={"rows": tr.n_rows, "continuation": list(y)})]
