"""An append-only flow, the prefix cache's own ground: forwards and wall time per append.

``n_chunks`` chunks of real text are appended one after another to a fresh window (no budget:
nothing slides) under each patch policy, and fed to a prefix cache: one forward of the chunk's
tokens attending to the cached KV of everything before it, the cache then extended by the
chunk's KV. Both sides are timed in the same run, interleaved chunk by chunk so machine noise
hits both alike; the first chunk (no antecedent) is reported but left out of the per-append
means, which cover appends 2..n. Prints numbers, asserts nothing.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from ..patch.rank import DEFAULT_RANK


@dataclass
class AppendFlowRow:
    policy: str
    appends: int
    forwards_per_append: float  # appends 2..n
    prefix_forwards_per_append: float
    ms_per_append: float  # median over appends 2..n
    prefix_ms_per_append: float
    first_forwards: int
    wall_ratio: float  # window / prefix cache (median ms)
    forward_ratio: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_append_flow(backend: Any, chunks: list[list[int]], *, policies: tuple[str, ...] = ("eager", "latency"),
                    rank: int = DEFAULT_RANK) -> list[AppendFlowRow]:
    """One row per policy (see the module docstring)."""
    from ..core.kv import concat_kv
    from ..window import ContextWindow

    rows = []
    for policy in policies:
        win = ContextWindow(backend, rank=rank, patch_policy=policy)
        root = backend.root_kv()
        past = [(k.clone(), v.clone()) for k, v in root]
        pos = backend.root_len
        win_ms, win_fw, pc_ms, pc_fw = [], [], [], []
        for ids in chunks:
            t = time.perf_counter()
            ref = win.append(token_ids=ids)
            win_ms.append((time.perf_counter() - t) * 1000.0)
            win_fw.append(ref.receipt.forwards)
            f0 = backend.forwards_run
            t = time.perf_counter()
            res = backend.forward(input_ids=ids, positions=backend.text_positions(pos, len(ids)), past=past, logits="none")
            past = concat_kv([past, res.kv])
            pc_ms.append((time.perf_counter() - t) * 1000.0)
            pc_fw.append(backend.forwards_run - f0)
            pos += len(ids)
        win.close()
        later = slice(1, None)
        wm, pm = statistics.median(win_ms[later]), statistics.median(pc_ms[later])
        wf, pf = statistics.mean(win_fw[later]), statistics.mean(pc_fw[later])
        rows.append(AppendFlowRow(
            policy=policy, appends=len(chunks), forwards_per_append=round(wf, 3), prefix_forwards_per_append=round(pf, 3),
            ms_per_append=round(wm, 2), prefix_ms_per_append=round(pm, 2), first_forwards=win_fw[0],
            wall_ratio=round(wm / max(pm, 1e-9), 3), forward_ratio=round(wf / max(pf, 1e-9), 3),
        ))
    return rows


__all__ = ["AppendFlowRow", "run_append_flow"]
