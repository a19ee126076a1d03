"""What a recall miss costs on the critical path, and what it buys: ``contextdeque window-bench --miss``.

A window of ``n_pages`` pages of real text (``pydoc_data.topics``) is built under the eager policy
with a budget of exactly that many pages; the first page read slid out. Two scenarios, each against
a re-prefill of the same window + a 10-token question (next-token KL at answer time):

**recall at the end** (the recalled page behind every survivor; survivors keep their KV as-is, the
seed paper's rule): only the recalled page's own KV differs between arms —

- ``blind``: its canonical relocated (a latency-first miss today: 0 forwards);
- ``patch(m)``: a rank-m recall patch, one conditioned forward over the page behind the window;
- ``patch(full)``: every direction (the page recomputed in context, the ceiling of one forward);
- ``deep-patch(m)``: a layer-sparse patch, rank m on the deepest half of the layers only (the same
  forward, half the factor bytes);
- ``shallow@l(m|full)``: a shallow recompute: only decoder layers ``l..L-1`` run over the page in
  context, starting from the page's **stored mid-depth state** (the hidden state entering layer
  ``l`` from its canonical encode, kept beside the canonical: ``T x hidden`` values); the shallow
  layers keep the canonical. ``(L-l)/L`` of a forward; stored at full rank or as a rank-m deep patch.

**look-back in front** (``recall(page, at=0)``: the page is exact there, but every chunk behind it
is now behind one more antecedent): the dependent tail ``keep`` (0 forwards) vs ``reform`` (every
chunk behind re-patched: one forward each).

``forwards`` counts layer passes in units of one full forward over the page (a shallow recompute at
layer l: ``(L-l)/L``). ``critical ms``: median of ``runs`` timings of what the step runs before the
answer can start (the forward(s), the SVD, the page's placement; the look-back rows: one run each,
as the window runs them). Nothing is asserted: it prints
what it measured.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..core.kv import concat_kv
from ..core.metrics import kl_divergence
from ..core.operator import relocate, to_content_frame
from ..model.forward import run_deep_forward, run_hidden_at
from ..patch import form_patch
from ..window.placement import END
from ..window.window import ContextWindow
from .step_bench import _answer_logits, _reprefill, _window_ids, sync


@dataclass
class MissRow:
    scenario: str
    arm: str
    forwards: float
    critical_ms: float
    patch_kib: float
    kl_answer: float
    eta: float | None  # (KL_blind - KL_arm) / KL_blind: the share of the blind gap closed

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def _median_ms(fn: Callable[[], Any], runs: int, device: Any) -> tuple[Any, float]:
    times, out = [], None
    for _ in range(max(1, runs)):
        sync(device)
        t = time.perf_counter()
        out = fn()
        sync(device)
        times.append((time.perf_counter() - t) * 1000.0)
    return out, statistics.median(times)


def _answer(backend: Any, past: list, question: list[int], start: int) -> torch.Tensor:
    return backend.forward(input_ids=question, positions=backend.text_positions(start, len(question)), past=past).logits[-1]


def shallow_recompute_kv(backend: Any, chunk: Any, start: int, past: list, hidden: torch.Tensor, first_layer: int) -> list:
    """The page of ``chunk`` at ``start`` behind ``past`` (root + antecedents, as cached) with layers
    ``first_layer..L-1`` recomputed in context from ``hidden`` (its stored state entering
    ``first_layer``) and the shallow layers from its canonical: per layer ``(k, v)`` as cached."""
    pos = chunk.positions(start)
    deep = run_deep_forward(backend.model, backend.n_pos_axes, hidden=hidden, first_layer=first_layer, positions=pos,
                            past=past)
    shallow = list(relocate(chunk, start, layout=backend.layout, beyond_trained=True))[:first_layer]
    dtype = deep[0][0].dtype
    return [(k.to(dtype), v.to(dtype)) for k, v in shallow] + deep


def run_miss_bench(backend: Any, pages: list[list[int]], question: list[int], *, rank: int = 32, runs: int = 3,
                   shallow_layers: tuple[float, ...] = (0.25, 0.5, 0.75),
                   progress: Callable[[str], None] | None = None) -> list[MissRow]:
    """Measure every arm of the module doc. ``pages``: ``n_pages + 1`` equal pages (the first is the
    one recalled). ``shallow_layers``: where shallow recomputes start, as fractions of the depth."""
    size, n_pages = len(pages[0]), len(pages) - 1
    L = backend.layout.num_layers
    win = ContextWindow(backend, budget_tokens=n_pages * size, rank=rank, patch_policy="eager")
    old_ref = win.append(chunk=backend.encode(token_ids=pages[0]))
    for p in pages[1:]:
        win.append(chunk=backend.encode(token_ids=p))
    rows: list[MissRow] = []
    dev = backend.device

    # ---- recall at the end: the survivors as the eager recall leaves them, the recalled page per arm
    lead = win.fork()
    lead.recall(old_ref, at=END)  # the budget slides the oldest page out; survivors keep their KV
    ants = [r for r in lead.refs if r != old_ref]
    past = concat_kv([backend.root_kv(), *(lead.kv(r) for r in ants)])
    chunk = lead.chunk(old_ref)
    start = lead.slot(old_ref).start
    q_start = lead.next_position()
    ref_logits, _ = _reprefill(backend, _window_ids(lead) + question)
    antecedents = [lead.chunk(r) for r in ants]
    lead.discard()

    def arm(name: str, fwd: float, build: Callable[[], tuple[list, int]]) -> None:
        if progress:
            progress(f"recall-end: {name}")
        (page, nbytes), ms = _median_ms(build, runs, dev)
        logits = _answer(backend, concat_kv([past, page]), question, q_start)
        rows.append(MissRow("recall-end", name, fwd, ms, nbytes / 1024, kl_divergence(ref_logits, logits), None))

    def patched(kind: str, r: Any, **opts: Any) -> Callable[[], tuple[list, int]]:
        def build() -> tuple[list, int]:
            p = form_patch(backend, chunk, antecedents=antecedents, rank=r, kind=kind, past=past, **opts)
            return list(relocate(chunk, start, layout=backend.layout, patch=p, beyond_trained=True)), p.nbytes
        return build

    arm("blind", 0.0, lambda: (list(relocate(chunk, start, layout=backend.layout, beyond_trained=True)), 0))
    arm(f"patch({rank})", 1.0, patched("exact", rank))
    arm("patch(full)", 1.0, patched("exact", "full"))
    half = L // 2
    arm(f"deep-patch({rank}, {half}/{L} layers)", 1.0, patched("deep", rank, deep_layers=half))
    root = backend.root_kv()
    for first in sorted({max(1, min(L - 1, round(frac * L))) for frac in shallow_layers}):
        # the stored mid-depth state: from the canonical encode (page after the root), off the critical path
        hidden = run_hidden_at(backend.model, backend.n_pos_axes, input_ids=chunk.token_ids,
                               positions=chunk.positions(backend.root_len), past=root, layer=first)
        for r in ("full", rank):
            def build(first: int = first, hidden: torch.Tensor = hidden, r: Any = r) -> tuple[list, int]:
                kv = shallow_recompute_kv(backend, chunk, start, past, hidden, first)
                if r == "full":
                    return kv, 0
                pos = chunk.positions(start)
                keys, values = to_content_frame(kv, backend.layout, pos)
                p = form_patch(backend, chunk, antecedents=antecedents, rank=r, kind="deep", deep_layers=L - first,
                               conditioned=(keys, values))
                return list(relocate(chunk, start, layout=backend.layout, patch=p, beyond_trained=True)), p.nbytes
            arm(f"shallow@{first}/{L}({r})", (L - first) / L, build)
    blind_kl = rows[0].kl_answer
    for row in rows:
        row.eta = None if blind_kl <= 0 else (blind_kl - row.kl_answer) / blind_kl

    # ---- look-back in front: the page exact at the front, the tail behind it kept or re-formed
    # (once each: a fork shares the store, so a second run would find the first run's patches)
    for tail in ("keep", "reform"):
        if progress:
            progress(f"look-back: tail {tail}")
        child = win.fork()
        sync(dev)
        t = time.perf_counter()
        receipt = child.recall(old_ref, at=0)
        if tail == "reform":
            receipt = receipt + child.refresh([r for r in child.refs if r != old_ref])
        sync(dev)
        ms = (time.perf_counter() - t) * 1000.0
        ref_logits, _ = _reprefill(backend, _window_ids(child) + question)
        kl = kl_divergence(ref_logits, _answer_logits(child, question))
        child.discard()
        rows.append(MissRow("look-back", f"tail {tail}", float(receipt.forwards), ms, 0.0, kl, None))
    win.close()
    return rows
