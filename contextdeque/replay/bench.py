"""``contextdeque replay-bench``: the replay's benchmark figures, measured and printed.

1. cost-model throughput, events/s on one core, per (placement, arm) on a generated set;
2. scheduler vs arrival order: patch forms per agent kind (equal budgets), aggregate;
3. the scheduler's heuristic over its exact search at every decision of <= 8 chunks;
4. with ``--mooncake FILE``: the imported trace under every policy combination (process pool),
   and each online eviction policy's gap to the offline yardstick (Belady, size-aware).

Wall-clock figures depend on the machine and its load: compare them within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ..scheduler import SchedulerPlacement, exact, heuristic
from .pool import REPLAY_EVICTIONS
from ..traces import generate, import_mooncake
from ..window.placement import PLACEMENT_POLICIES, PlacementView
from ..scheduler.cost_model import load_calibration
from .engine import ReplayConfig, Replayer
from .reuse import REUSE_COSTS
from .run import default_jobs, replay_many

GiB = 1 << 30


class _RatioProbe(SchedulerPlacement):
    """The scheduler, also pricing the heuristic against the exact search where both apply."""

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[tuple[float, float]] = []

    def place(self, view: PlacementView, entering):  # type: ignore[override]
        if view.conditioning and entering and len(view.order) + len(entering) <= self.exact_max:
            _, hc = heuristic(view, entering, self.weights)
            _, ec = exact(view, entering, self.weights)
            self.pairs.append((hc, ec))
        return super().place(view, entering)


def throughput(seeds: int = 2, min_cpu_s: float = 1.0) -> list[dict[str, Any]]:
    """Events/s of the cost-model replay per (placement, arm) over ``seeds`` generated traces per
    kind, repeated until at least ``min_cpu_s`` CPU seconds were spent (a steadier figure)."""
    rows = []
    traces = [generate(k, seed=s) for k in ("web", "video", "doc") for s in range(seeds)]
    n_events = sum(len(t.events) for t in traces)
    for placement in sorted(PLACEMENT_POLICIES):
        for arm in sorted(REUSE_COSTS):
            t0, c0 = time.perf_counter(), time.process_time()
            events = 0
            while True:
                for t in traces:
                    Replayer(t, placement, "lru", arm).run()
                events += n_events
                if time.process_time() - c0 >= min_cpu_s:
                    break
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            # CPU seconds of this (single-threaded) process: one core's throughput, much less
            # sensitive than wall time to other processes sharing the machine
            rows.append({"placement": placement, "arm": arm, "events": events, "events_per_s": events / dt,
                         "events_per_cpu_s": events / max(dc, 1e-9)})
    return rows


def scheduler_vs_arrival(seeds: int = 4, budgets: tuple[int | None, ...] = (None,), first_seed: int = 0) -> dict[str, Any]:
    """Patch forms per generated trace under arrival order, the scheduler and the offline scheduler
    (equal budgets), tokens prefilled per reuse arm, and the heuristic's cost over the exact
    search's at every decision of at most 8 chunks."""
    out: dict[str, Any] = {}
    ratios = []
    for budget in budgets:
        cfg = ReplayConfig(budget_tokens=budget)
        tag = "no budget" if budget is None else f"budget {budget} tokens"
        out[tag] = {}
        for kind in ("web", "video", "doc"):
            per: dict[str, list[int]] = {"arrival": [], "scheduler": [], "scheduler-offline": []}
            prefill = {"patch": 0, "patch-latency": 0, "prefix_cache": 0, "reprefill": 0, "kvcapsule-linear": 0, "snapkv-256": 0}
            critical = dict.fromkeys(prefill, 0)
            for s in range(first_seed, first_seed + seeds):
                t = generate(kind, seed=s)
                per["arrival"].append(Replayer(t, "arrival", "lru", "patch", config=cfg).run().patch_forms)
                probe = _RatioProbe()
                per["scheduler"].append(Replayer(t, probe, "lru", "patch", config=cfg).run().patch_forms)
                per["scheduler-offline"].append(Replayer(t, "scheduler-offline", "lru", "patch", config=cfg).run().patch_forms)
                ratios += [h / e for h, e in probe.pairs if e > 0]
                for arm in prefill:
                    r = Replayer(t, "arrival", "lru", arm, config=cfg).run()
                    prefill[arm] += r.tokens_prefilled
                    critical[arm] += r.tokens_prefilled - r.heal_tokens
            out[tag][kind] = {
                **{f"{p}_forms": v for p, v in per.items()},
                "more_than_arrival": {p: [(first_seed + s, f, a) for s, (f, a) in enumerate(zip(per[p], per["arrival"])) if f > a]
                                      for p in ("scheduler", "scheduler-offline")},
                "aggregate": {p: sum(v) for p, v in per.items()},
                "tokens_prefilled": prefill,
                "tokens_prefilled_critical_path": critical,  # less what latency-first heals in idle time
            }
    out["heuristic_over_exact"] = {
        "decisions": len(ratios), "mean": statistics.fmean(ratios) if ratios else None,
        "max": max(ratios) if ratios else None, "share_equal": (sum(1 for r in ratios if r <= 1 + 1e-9) / len(ratios)) if ratios else None,
    }
    return out


def mooncake(path: str, jobs: int, device_gb: float, limit: int | None) -> dict[str, Any]:
    cost, note = load_calibration()
    t = import_mooncake(path, limit=limit)
    cfg = ReplayConfig(device_bytes=int(device_gb * GiB), host_bytes=int(4 * device_gb * GiB))
    combos = [(p, e, a) for p in sorted(PLACEMENT_POLICIES) for e in REPLAY_EVICTIONS for a in sorted(REUSE_COSTS)]
    t0 = time.perf_counter()
    results = replay_many([t], combos, cost, cfg, jobs=jobs)
    wall = time.perf_counter() - t0
    gaps = []
    for p in sorted(PLACEMENT_POLICIES):
        for a in sorted(REUSE_COSTS):
            by = {r["eviction"]: r for r in results if r["placement"] == p and r["arm"] == a}
            yard = by["belady"]
            for e, r in by.items():
                if e == "belady":
                    continue
                gaps.append({"placement": p, "arm": a, "eviction": e,
                             "misses": r["device_misses"], "belady_misses": yard["device_misses"],
                             "miss_gap": (r["device_misses"] - yard["device_misses"]) / max(1, yard["device_misses"]),
                             "seconds_gap": (r["est_seconds"] - yard["est_seconds"]) / max(1e-9, yard["est_seconds"])})
    return {"requests": t.header.meta.get("requests"), "events": len(t.events), "calibration": note,
            "device_gb": device_gb, "wall_s": wall, "results": results, "eviction_gaps": gaps}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=4, help="generated traces per agent kind")
    parser.add_argument("--first-seed", type=int, default=0, help="the first generated trace's seed (held-out sets)")
    parser.add_argument("--no-throughput", action="store_true", help="skip the throughput figures")
    parser.add_argument("--budgets", type=int, nargs="+", default=[0], help="window token budgets to compare at (0: none)")
    parser.add_argument("--mooncake", default=None, help="a Mooncake FAST'25 trace file to replay under every policy")
    parser.add_argument("--limit", type=int, default=None, help="only the first N Mooncake requests")
    parser.add_argument("--device-gb", type=float, default=16.0)
    parser.add_argument("--jobs", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write every figure here")


def run(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {}
    if not args.no_throughput:
        report["throughput"] = throughput(max(1, args.seeds // 2))
        print("cost-model throughput (events/s, one process; per wall second and per CPU second of its core):")
        for r in report["throughput"]:
            print(f"  {r['placement']:17s} {r['arm']:16s} {r['events_per_s']:10.0f} /wall-s {r['events_per_cpu_s']:10.0f} /cpu-s")
    report["scheduler"] = scheduler_vs_arrival(args.seeds, tuple(None if b <= 0 else b for b in args.budgets), args.first_seed)
    print(f"patch forms over {args.seeds} generated traces per kind, arrival -> scheduler / scheduler-offline (equal budgets):")
    for tag, kinds in report["scheduler"].items():
        if tag == "heuristic_over_exact":
            continue
        for kind in ("web", "video", "doc"):
            s = kinds[kind]
            agg = s["aggregate"]
            print(f"  {tag:20s} {kind:6s} aggregate {agg['arrival']} -> {agg['scheduler']} / {agg['scheduler-offline']}"
                  f"  traces with more forms than arrival: {s['more_than_arrival']}")
            print(f"  {'':20s} {kind:6s} tokens prefilled (arrival order) {s['tokens_prefilled']}")
            print(f"  {'':20s} {kind:6s} of them on the critical path     {s['tokens_prefilled_critical_path']}")
    h = report["scheduler"]["heuristic_over_exact"]
    print(f"heuristic / exact cost over {h['decisions']} decisions: mean {h['mean']}, max {h['max']}, equal in {h['share_equal']}")
    if args.mooncake:
        m = mooncake(args.mooncake, args.jobs or default_jobs(), args.device_gb, args.limit)
        report["mooncake"] = m
        print(f"Mooncake: {m['requests']} requests, {m['events']} events, {len(m['results'])} combos in {m['wall_s']:.0f} s wall; {m['calibration']}")
        for r in m["results"]:
            print(f"  {r['placement']:10s} {r['eviction']:15s} {r['arm']:13s} tokens_prefilled {r['tokens_prefilled']:>12d} "
                  f"forms {r['patch_forms']:>7d} hits {r['patch_hits']:>7d} dev_miss {r['device_misses']:>7d} est_s {r['est_seconds']:.4g}")
        print("eviction gaps to Belady (device misses):")
        for g in m["eviction_gaps"]:
            print(f"  {g['placement']:10s} {g['arm']:13s} {g['eviction']:15s} {g['misses']} vs {g['belady_misses']}  gap {g['miss_gap']:+.3f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, sort_keys=True, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="contextdeque replay-bench")
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
