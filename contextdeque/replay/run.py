"""Running many traces under many policy combinations, in parallel and deterministically.

A *combo* is ``(placement, eviction, arm)``. :func:`replay_many` runs every (trace, combo) pair,
over a process pool when ``jobs > 1`` (each worker reads each trace once), and returns results
sorted by (trace, placement, eviction, arm): the same inputs give the same list, and
:func:`to_json` turns it into byte-identical JSON (no wall-clock figures in it).
"""

from __future__ import annotations

import functools
import itertools
import json
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from typing import Any, Callable, Iterable, Sequence

from .pool import REPLAY_EVICTIONS
from ..core.errors import PolicyError
from ..traces.io import Trace, read_trace
from ..window.placement import PLACEMENT_POLICIES
from ..scheduler.cost_model import CostModel
from .engine import ReplayConfig, Replayer
from .live import idle_budget
from .reuse import REUSE_COSTS, is_reuse

Combo = tuple[str, str, str]


def parse_combos(specs: Iterable[str] | None, placements: Sequence[str], evictions: Sequence[str], arms: Sequence[str]) -> list[Combo]:
    """Combos from ``PLACEMENT:EVICTION:ARM`` specs (``*`` = every registered one), else the
    product of the three lists. Unknown names raise PolicyError naming what is registered."""
    out: list[Combo] = []
    if specs:
        for spec in specs:
            parts = spec.split(":")
            if len(parts) != 3:
                raise PolicyError(f"policy combo {spec!r} must be PLACEMENT:EVICTION:ARM (use * for all)")
            pools = [sorted(PLACEMENT_POLICIES), list(REPLAY_EVICTIONS), sorted(REUSE_COSTS)]
            picked = [pool if p == "*" else [p] for p, pool in zip(parts, pools)]
            out.extend(itertools.product(*picked))
    else:
        out = list(itertools.product(placements, evictions, arms))
    for p, e, a in out:
        if p not in PLACEMENT_POLICIES:
            raise PolicyError(f"unknown placement {p!r}; registered: {sorted(PLACEMENT_POLICIES)}")
        if e not in REPLAY_EVICTIONS:
            raise PolicyError(f"unknown eviction {e!r}; registered: {list(REPLAY_EVICTIONS)}")
        if not is_reuse(a):
            raise PolicyError(f"unknown reuse arm {a!r}; known: {sorted(REUSE_COSTS)} (budgeted: NAME-ROWS)")
    return sorted(set(out))


@functools.lru_cache(maxsize=8)
def _cached_trace(path: str) -> Trace:
    return read_trace(path)


_SHARED: list[Trace] = []  # traces handed to forked workers by index (inherited, never pickled)


def _one(task: tuple[Any, Combo, dict, dict, float | None, float, float, float, bool]) -> dict[str, Any]:
    trace, (p, e, a), cost_d, cfg_d, idle_rate, factorization_cost, factorization_fixed, forward_fixed, hints = task
    t = _cached_trace(trace) if isinstance(trace, str) else _SHARED[trace] if isinstance(trace, int) else trace
    idle_tokens = None if idle_rate is None else idle_budget(idle_rate)
    eng = Replayer(t, p, e, a, CostModel.from_json(cost_d), ReplayConfig(**cfg_d), idle_tokens=idle_tokens,
                   factorization_cost=factorization_cost, factorization_fixed=factorization_fixed, forward_fixed=forward_fixed,
                   hints=hints)
    return eng.run().as_dict()


def check_budgets(traces: Sequence[Trace], cost: CostModel, config: ReplayConfig) -> None:
    """Refuse a budget below one chunk before anything runs (BudgetError)."""
    for t in traces:
        Replayer(t, "arrival", "lru", "patch", cost, config)


def replay_many(traces: Sequence["str | Trace"], combos: Sequence[Combo], cost: CostModel | None = None,
                config: ReplayConfig | None = None, jobs: int = 1, progress: Callable[[int, int], None] | None = None,
                idle_rate: float | None = None, factorization_cost: float = 0.0,
                factorization_fixed: float = 0.0, forward_fixed: float = 0.0, hints: bool = True) -> list[dict[str, Any]]:
    """Every (trace, combo) result, sorted. ``traces``: paths (validated whole, once per worker)
    or :class:`Trace` objects. ``jobs``: worker processes (1: in this process). ``progress(done,
    total)`` is called as runs finish (their order of finishing does not change the result).
    ``idle_rate`` (trace tokens prefilled per idle second; None: heal to completion at every
    step): each ``step``'s idle gap is a heal budget (``live.idle_budget``) charging
    ``factorization_cost`` per factorized token, ``factorization_fixed`` per factorized patch and
    ``forward_fixed`` per forward, as the fidelity mode's live window spends it. ``hints``: pass
    the traces' ``expect`` events on (False: ``--ignore-hints``, on both sides)."""
    cost = cost or CostModel()
    config = config or ReplayConfig()
    loaded = [_cached_trace(str(t)) if not isinstance(t, Trace) else t for t in traces]  # validate all first
    check_budgets(loaded, cost, config)
    fork = "fork" in mp.get_all_start_methods()
    parallel = jobs > 1 and len(traces) * len(combos) > 1
    if parallel and fork:
        # forked workers inherit the validated traces: a task names one by index instead of
        # pickling it (a Mooncake trace is half a million events) or re-reading its file
        _SHARED[:] = loaded
        refs: list[Any] = list(range(len(loaded)))
    else:
        refs = [str(t) if not isinstance(t, Trace) else lt for t, lt in zip(traces, loaded)]
    tasks = [(ref, c, cost.to_json(), asdict(config), idle_rate, float(factorization_cost),
              float(factorization_fixed), float(forward_fixed), bool(hints)) for ref in refs for c in combos]
    results: list[dict[str, Any]] = []

    def done(r: dict[str, Any]) -> None:
        results.append(r)
        if progress is not None:
            progress(len(results), len(tasks))

    try:
        if parallel:
            ctx = mp.get_context("fork" if fork else "spawn")
            with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
                for fut in as_completed([pool.submit(_one, t) for t in tasks]):
                    done(fut.result())
        else:
            for t in tasks:
                done(_one(t))
    finally:
        _SHARED.clear()
    return sorted(results, key=lambda r: (r["trace"], r["placement"], r["eviction"], r["arm"]))


def default_jobs() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def to_json(results: list[dict[str, Any]], cost: CostModel, note: str, config: ReplayConfig, extra: dict | None = None) -> str:
    """One JSON object: ``results`` (each with trace, placement, eviction, arm, tokens_prefilled,
    patch_forms, est_seconds, ...), the calibration used and the budgets. Deterministic bytes."""
    doc = {
        "results": results,
        "calibration": {"source": cost.source, "fingerprint": cost.fingerprint, "model": cost.model, "note": note},
        "config": asdict(config),
        **(extra or {}),
    }
    return json.dumps(doc, sort_keys=True, indent=1)
