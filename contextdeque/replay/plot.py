"""``replay --plot``: PNG figures of a replay (matplotlib, Agg backend, no display needed).

One figure with four panels: cumulative estimated seconds per policy over the trace's steps
(re-run for the series), hit rates (patch hits over patch uses, device-pool hits over pool
accesses), bytes by tier, and — under ``--fidelity`` — estimated seconds vs median η per policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..traces.io import Trace
from ..scheduler.cost_model import CostModel
from .engine import ReplayConfig, Replayer


def _label(r: dict[str, Any]) -> str:
    return f"{r['placement']}/{r['eviction']}/{r['arm']}"


def cumulative_series(trace: Trace, placement: str, eviction: str, arm: str, cost: CostModel, config: ReplayConfig) -> list[float]:
    """Estimated seconds after each step of ``trace`` under one combo (re-run with a step tap)."""
    eng = Replayer(trace, placement, eviction, arm, cost, config)
    series: list[float] = []
    eng.on_step = lambda: series.append(eng.r.est_seconds)
    eng.run()
    series.append(eng.r.est_seconds)
    return series


def write_plot(path: str | Path, results: Sequence[dict[str, Any]], traces: dict[str, Trace], cost: CostModel,
               config: ReplayConfig, max_series: int = 12) -> Path:
    """Write the figure to ``path`` (PNG); returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    for r in list(results)[:max_series]:
        t = traces.get(r["trace"])
        if t is None:
            continue
        s = cumulative_series(t, r["placement"], r["eviction"], r["arm"], cost, config)
        ax.plot(range(len(s)), s, label=f"{r['trace']}: {_label(r)}", linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("estimated seconds (cumulative)")
    ax.set_title("cumulative cost")
    ax.legend(fontsize=6)

    labels = [f"{r['trace']}\n{_label(r)}" for r in results]
    ax = axes[0][1]
    uses = [r["patch_hits"] + r["patch_forms"] for r in results]
    patch_rate = [(r["patch_hits"] / u) if u else 0.0 for r, u in zip(results, uses)]
    pool = [r["device_hits"] + r["device_misses"] for r in results]
    pool_rate = [(r["device_hits"] / n) if n else 0.0 for r, n in zip(results, pool)]
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], patch_rate, width=0.4, label="patch hit rate")
    ax.bar([i + 0.2 for i in x], pool_rate, width=0.4, label="device pool hit rate")
    ax.set_xticks(list(x), labels, rotation=90, fontsize=6)
    ax.set_ylim(0, 1)
    ax.set_title("hit rates")
    ax.legend(fontsize=7)

    ax = axes[1][0]
    bottom = [0.0] * len(results)
    for tier in ("device", "host", "disk"):
        vals = [r["bytes"][tier] / 2**30 for r in results]
        ax.bar(list(x), vals, bottom=bottom, label=tier)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(list(x), labels, rotation=90, fontsize=6)
    ax.set_ylabel("GiB moved")
    ax.set_title("bytes by tier")
    ax.legend(fontsize=7)

    ax = axes[1][1]
    pts = [(r["est_seconds"], r.get("eta"), _label(r)) for r in results if r.get("eta") is not None]
    if pts:
        for s, e, lab in pts:
            ax.scatter([s], [e], label=lab)
        ax.set_xlabel("estimated seconds")
        ax.set_ylabel("median η (fidelity mode)")
        ax.legend(fontsize=6)
    else:
        ax.bar(list(x), [r["est_seconds"] for r in results])
        ax.set_xticks(list(x), labels, rotation=90, fontsize=6)
        ax.set_ylabel("estimated seconds")
    ax.set_title("cost vs fidelity" if pts else "cost per policy (run --fidelity N for η)")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
