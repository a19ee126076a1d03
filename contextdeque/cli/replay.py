"""``contextdeque replay``: replay traces under placement x eviction x reuse-arm combinations."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..core.errors import ArgumentError, ContextDequeError
from .model_spec import add_threads_argument, apply_threads_argument
from .window_options import add_fidelity_target_arguments, add_window_arguments, window_options

GiB = 1 << 30


def _csv(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", type=Path, help="trace files (.jsonl, .jsonl.gz, .jsonl.xz)")
    parser.add_argument("--policies", nargs="+", metavar="P:E:A", help="combos PLACEMENT:EVICTION:ARM (* = all registered)")
    parser.add_argument("--placement", type=_csv, default=["arrival", "scheduler"], help="placements (comma list)")
    parser.add_argument("--eviction", type=_csv, default=["lru"], help="eviction policies (comma list)")
    parser.add_argument("--arm", type=_csv, default=["patch", "prefix_cache", "reprefill"], help="reuse arms (comma list)")
    parser.add_argument("--budget-tokens", type=int, default=None, help="window token budget (default: the trace's own)")
    parser.add_argument("--device-gb", type=float, default=16.0, help="device KV pool budget, GiB")
    parser.add_argument("--host-gb", type=float, default=64.0, help="host tier budget, GiB")
    parser.add_argument("--overlap-loads", action="store_true",
                        help="host/disk loads of canonicals overlap the model's work of the same admission (MPIC; ContextWindow.extend)")
    parser.add_argument("--jobs", type=int, default=0, help="worker processes (0: all cores)")
    parser.add_argument("--calibration", type=Path, default=None, help="a saved calibration (default: the newest saved)")
    parser.add_argument("--fidelity", type=int, default=0, metavar="N",
                        help="also drive a real ContextWindow on the default model and measure KL / η / TTFT ratio at N sampled queries per policy")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fidelity mode's query sample")
    add_threads_argument(parser)
    add_window_arguments(parser, policy="eager", rank=None, rank_help="patch rank m (default: the calibration's)",
                         policy_help="the fidelity mode's patch policy for the patch arm (eager, as the cost model "
                                     "prices it; latency, exact, ...); latency-first windows are also measured after "
                                     "heal(). 'latency' / 'latency-shared' also price the patch arm so in cost-model "
                                     "mode (arms patch-latency / patch-latency-shared)")
    parser.add_argument("--idle-rate", default=None, metavar="TOKENS_PER_S",
                        help="fidelity mode: honour the traces' idle gaps (step idle / time): each becomes a heal budget of "
                             "idle seconds x TOKENS_PER_S trace tokens (scaled like the chunks), spent by heal() with "
                             "anticipation on, and the patch arm reports the anticipation hit rate per step type; "
                             "'calibrated': the cost model's prefill rate at 2,048 tokens of context beyond a forward's fixed part "
                             "(which every forward is charged besides: CostModel.forward_fixed_s)")
    parser.add_argument("--ignore-hints", action="store_true",
                        help="with --idle-rate: do not pass the traces' expect events (what the agent said it will re-read) on")
    parser.add_argument("--predictor", default="session",
                        help="with --idle-rate: the window's recall predictor (session, recency, ...; window.predictor)")
    add_fidelity_target_arguments(parser, "the fidelity mode's patch window gets this η target (docs/fidelity.md); the "
                                          "patches its byte cap could not fit it into are counted and listed with --json")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG figure here")
    parser.add_argument("--json", action="store_true", help="print one JSON object (deterministic) instead of tables")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..scheduler.cost_model import load_calibration
    from ..replay.engine import ReplayConfig
    from ..replay.run import default_jobs, parse_combos, replay_many, to_json

    if args.plot:
        import matplotlib  # noqa: F401  (the plot extra: named now, not after the run)
    err = Console(stderr=True)
    missing = [str(p) for p in args.traces if not p.is_file()]
    if missing:  # before any work or notes: the one line the user needs
        print(f"error: no such trace file: {', '.join(missing)}", file=sys.stderr)
        return 1
    try:
        combos = parse_combos(args.policies, args.placement, args.eviction, args.arm)
        if args.patch_policy in ("latency", "latency-shared"):  # the cost rule for the patch arm on such a window
            rule = "patch-" + args.patch_policy
            combos = sorted({(p, e, rule if a == "patch" else a) for p, e, a in combos})
        cost, note = load_calibration(path=args.calibration)
        idle_rate = _idle_rate(args.idle_rate, cost)
        if idle_rate is not None and not args.fidelity:
            raise ArgumentError("--idle-rate needs --fidelity N (it drives a real window through the traces)")
        # with --idle-rate the cost model prices the window the fidelity mode drives: the same idle
        # budget per step (in the trace's own tokens), its factorization charge and anticipation
        idle = {} if idle_rate is None else {"anticipate": True, "recall_predictor": args.predictor}
        config = ReplayConfig(budget_tokens=args.budget_tokens, device_bytes=int(args.device_gb * GiB),
                              host_bytes=int(args.host_gb * GiB), rank=args.rank, overlap_loads=args.overlap_loads, **idle)
        charges: dict[str, float] = {}
        if idle_rate is not None:
            from ..replay.fidelity import idle_charges

            # the cost model's side runs the trace at full scale, the fidelity mode's window at its
            # scale: per-forward and per-patch charges are scaled with the budgets (replay.fidelity)
            charges = idle_charges(cost, 1.0)
        jobs = args.jobs or default_jobs()
        err.print(f"[dim]{note}[/dim]")
        err.print(f"[dim]replaying {len(args.traces)} trace(s) x {len(combos)} combo(s) on {jobs} process(es)[/dim]")
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("[dim]replay[/dim]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True, disable=not err.is_terminal) as bar:
            task = bar.add_task("replay", total=None)
            results = replay_many([str(p) for p in args.traces], combos, cost, config, jobs=jobs,
                                  progress=lambda done, total: bar.update(task, completed=done, total=total),
                                  idle_rate=idle_rate, hints=not args.ignore_hints, **charges)
        extra = {}
        if args.fidelity:
            from ..replay.fidelity import idle_charges, run_fidelity_mode

            apply_threads_argument(args)
            options = window_options(args)
            if idle_rate is not None:  # (a forming costs the idle budget its forwards and its factorization)
                options.update(anticipate=True, recall_predictor=args.predictor, **idle_charges(cost))
            fid = run_fidelity_mode([str(p) for p in args.traces], combos, args.fidelity, seed=args.seed, console=err,
                                    patch_policy=args.patch_policy, window_options=options, idle_rate=idle_rate,
                                    hints=not args.ignore_hints)
            for r in results:
                r.update(fid.get((r["trace"], r["placement"], r["eviction"], r["arm"]), {}))
            extra["fidelity"] = {"queries_per_policy": args.fidelity, "seed": args.seed, "model": "SmolLM2-135M-Instruct",
                                 "patch_policy": args.patch_policy, "idle_rate": idle_rate,
                                 "hints": not args.ignore_hints, **options}
    except (ContextDequeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.plot:
        from ..traces.io import read_trace
        from ..replay.plot import write_plot

        traces = {}
        for p in args.traces:
            t = read_trace(p)
            traces[t.name] = t
        out = write_plot(args.plot, results, traces, cost, config)
        err.print(f"[dim]plot written to {out}[/dim]")
    if args.json:
        print(to_json(results, cost, note, config, extra))
        return 0
    table = Table(title="replay (cost model)")
    cols = ["trace", "placement", "eviction", "arm", "tokens_prefilled", "forwards", "patch_forms", "patch_hits",
            "device_hits", "device_misses", "est_seconds"]
    if args.fidelity:
        cols += ["kl", "eta", "ttft_ratio"] + (["fidelity_misses", "fidelity_over_cap"] if args.fidelity_target else [])
    for c in cols:
        table.add_column(c, justify="right" if c not in ("trace", "placement", "eviction", "arm") else "left")
    for r in results:
        row = []
        for c in cols:
            v = r.get(c)
            row.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        table.add_row(*row)
    Console().print(table)
    if args.fidelity:
        Console().print(_step_table(results))
        if any(r.get("anticipation") for r in results):
            Console().print(_hit_table(results))
    return 0


def _idle_rate(spec: str | None, cost) -> float | None:
    """``--idle-rate``: a number of tokens per second, or ``calibrated`` (the cost model's prefill
    rate per token beyond a forward's fixed part, ``replay.fidelity.idle_token_s``)."""
    if spec is None:
        return None
    if spec == "calibrated":
        from ..replay.fidelity import idle_token_s

        return 1.0 / idle_token_s(cost)
    try:
        rate = float(spec)
    except ValueError:
        rate = -1.0
    if not rate >= 0:
        raise ArgumentError(f"--idle-rate: expected tokens per second (>= 0) or 'calibrated', got {spec!r}")
    return rate


def _hit_table(results: list[dict]) -> "Table":
    """The anticipation hit rate per step type (re-read steps answered fresh with 0 forwards)."""
    from rich.table import Table

    table = Table(title="anticipation hit rate per step type (answered fresh with 0 forwards; own: the cascade aside)")
    for c in ("trace", "placement", "arm", "step", "steps", "fresh", "rate", "own rate"):
        table.add_column(c, justify="left" if c in ("trace", "placement", "arm", "step") else "right")
    seen = set()
    for r in results:
        key = (r["trace"], r["placement"], r["arm"])
        hits = r.get("anticipation")
        if key in seen or not hits:
            continue
        seen.add(key)
        for step, h in hits["by_step"].items():
            table.add_row(*key, step, str(h["steps"]), str(h["hits"]), f"{h['rate']:.0%}", f"{h['own_rate']:.0%}")
        if hits["re_reads"]:
            table.add_row(*key, "re-reads (slide, recall, look-back, reorder)", str(hits["re_reads"]),
                          str(hits["re_read_hits"]), f"{hits['hit_rate']:.0%}", f"{hits['own_hit_rate']:.0%}")
    return table


def _step_table(results: list[dict]) -> "Table":
    """Fidelity per step type: the last window operation before each sampled query."""
    from rich.table import Table

    table = Table(title="fidelity per step type (KL vs re-prefill at answer time; after heal() where work was queued)")
    for c in ("trace", "placement", "arm", "step", "kl", "kl_healed", "ttft_ratio"):
        table.add_column(c, justify="left" if c in ("trace", "placement", "arm", "step") else "right")
    seen = set()
    for r in results:
        key = (r["trace"], r["placement"], r["arm"])
        if key in seen or not r.get("kl_by_step"):
            continue
        seen.add(key)
        for step, kl in r["kl_by_step"].items():
            healed = r.get("kl_healed_by_step", {}).get(step)
            ttft = r.get("ttft_ratio_by_step", {}).get(step)
            table.add_row(*key, step, f"{kl:.3g}", "-" if healed is None else f"{healed:.3g}",
                          "-" if ttft is None else f"{ttft:.3g}")
    return table
