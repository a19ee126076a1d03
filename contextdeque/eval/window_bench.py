"""``contextdeque window-bench``: what a slide and a fork cost on a 4x512-token window.

Builds a window of ``--chunks`` chunks of ``--chunk-tokens`` tokens of real text (Python's own
documentation, ``pydoc_data.topics``) on the default model, then measures (median of
``--runs``):

- ``slide``: ``slide(1)`` on the full window (survivors re-rotated from their content frame,
  nothing re-encoded; each run slides a fresh fork so every run sees the full window);
- ``fork``: ``fork()`` of the full window;
- ``fork_bytes_copied``: tensor bytes the child holds that the parent does not share (goal:
  0), and the same after the child diverges with one ``slide(1)``;
- for scale: ``materialize`` and one re-prefill forward of the same window;
- the per-step table (``step_bench``): slide, recall, look-back, reorder, fork+reorder and
  append, each followed by a one-token answer to a 10-token question, for the eager and the
  latency-first policy: time to first token vs a re-prefill and vs a prefix cache, forwards on
  the critical path, next-token KL vs the re-prefill at answer time and after ``heal()``
  (``--no-steps`` skips it).

Prints measured numbers (``--json`` for a machine-readable record); it asserts nothing.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from ..model.text import text_chunks as _chunks  # the one text source of the benches (its home is below eval)
from ..patch.rank import DEFAULT_RANK


def _question(backend: Any, n: int = 10) -> list[int]:
    """An ``n``-token question (ids folded into the vocabulary for a tokenizer-less model)."""
    text = " Which statement does the documentation above describe, and how is it used?"
    if backend.tokenizer is not None:
        ids = backend.tokenize(text)
    else:
        vocab = int(backend.model.config.vocab_size)
        ids = [3 + b % (vocab - 3) for b in text.encode()]
    return ids[:n]


def _page_storage(win: Any) -> dict[int, int]:
    """data_ptr -> bytes of every page tensor the window holds."""
    out: dict[int, int] = {}
    for ref in win.refs:
        for k, v in win.kv(ref):
            for t in (k, v):
                out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return out


def _unshared_bytes(child: Any, parent: Any) -> int:
    mine, theirs = _page_storage(child), _page_storage(parent)
    return sum(n for ptr, n in mine.items() if ptr not in theirs)


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000.0, 3)


def run_window_bench(
    backend: Any,
    *,
    n_chunks: int = 4,
    chunk_tokens: int = 512,
    runs: int = 7,
    policy: str = "default",
    rank: int = DEFAULT_RANK,
    step_policies: tuple[str, ...] = ("eager", "latency"),
    step_idle: bool = True,
    healer: bool = True,
    step_names: tuple[str, ...] | None = None,
    step_miss: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure everything the module docstring lists on a window of ``n_chunks`` chunks of
    ``chunk_tokens`` tokens (``step_policies=()`` skips the per-step table; ``step_idle``: heal
    between the steps that build its window, see ``step_bench.run_steps``; ``step_names``: which step
    types (default: every one of ``step_bench.STEPS``); ``step_miss``: also the same steps with no
idle time (what a miss costs; the latency-first policies only: an eager window has nothing to
heal, its rows would repeat), sharing the re-prefill references; ``progress``: told each step
as it starts; ``healer=False`` skips
    the idle healer's interference probe). Returns one dict,
    JSON-able but for ``steps`` (the per-step rows; each row's ``as_dict()`` is)."""
    from ..window import ContextWindow

    chunks = _chunks(backend, n_chunks, chunk_tokens)
    win = ContextWindow(backend, budget_tokens=n_chunks * chunk_tokens, rank=rank, patch_policy=policy)
    t0 = time.perf_counter()
    appends = [win.append(token_ids=c).receipt for c in chunks]
    build_s = time.perf_counter() - t0

    slide_s, slide_receipts = [], []
    for _ in range(max(1, runs)):
        child = win.fork()
        t = time.perf_counter()
        r = child.slide(1)
        slide_s.append(time.perf_counter() - t)
        slide_receipts.append(r)
        child.discard()

    fork_s = []
    for _ in range(max(1, runs)):
        t = time.perf_counter()
        child = win.fork()
        fork_s.append(time.perf_counter() - t)
        child.discard()

    child = win.fork()
    fork_receipt = win.last_receipt
    copied_at_fork = _unshared_bytes(child, win)
    diverge = child.slide(1)
    copied_after_slide = _unshared_bytes(child, win)
    child.discard()

    mat_s = []
    for _ in range(max(1, runs)):
        t = time.perf_counter()
        win.materialize()
        mat_s.append(time.perf_counter() - t)

    ids = list(backend.root_ids) + [i for c in chunks for i in c]
    t = time.perf_counter()
    backend.forward(input_ids=ids, positions=backend.text_positions(0, len(ids)), logits="none")
    reprefill_s = time.perf_counter() - t

    steps, healer = [], None
    if step_policies:
        from .step_bench import Oracles, healer_interference, run_steps

        pages = _chunks(backend, n_chunks + 2, chunk_tokens)
        oracles = Oracles(backend)
        which = {} if step_names is None else {"steps": step_names}
        steps = run_steps(backend, pages, _question(backend), policies=step_policies, rank=rank, n_pages=n_chunks,
                          idle=step_idle, oracles=oracles, progress=progress, **which)
        lazy = tuple(p for p in step_policies if p.split("+")[0] != "eager")
        if step_miss and step_idle and lazy:  # the healed columns are the idle table's: not again
            steps += run_steps(backend, pages, _question(backend), policies=lazy, rank=rank, n_pages=n_chunks,
                               idle=False, heal_after=False, oracles=oracles, progress=progress, **which)
            oracles.settle(steps)  # (the first table's rows: the medians over both)
        healer = healer_interference(backend, pages[:n_chunks], rank=rank) if healer else None

    last = slide_receipts[-1]
    result = {
        "model": backend.name,
        "device": str(backend.device),
        "threads": torch.get_num_threads(),
        "policy": policy,
        "rank": rank,
        "window": f"{n_chunks}x{chunk_tokens}",
        "runs": max(1, runs),
        "build_s": round(build_s, 3),
        "build_forwards": sum(r.forwards for r in appends),
        "slide_ms": _median_ms(slide_s),
        "slide_forwards": last.forwards,
        "slide_pages_written": last.pages_written,
        "slide_bytes_moved": last.bytes_moved,
        "fork_ms": _median_ms(fork_s),
        "fork_bytes_moved": fork_receipt.total_bytes_moved,
        "fork_bytes_copied": copied_at_fork,
        "fork_bytes_copied_after_child_slide": copied_after_slide,
        "child_slide_pages_bytes": diverge.bytes_moved.get("pages", 0),
        "materialize_ms": _median_ms(mat_s),
        "reprefill_ms": round(reprefill_s * 1000.0, 3),
        "steps": steps,
        "healer": healer,
    }
    return result
