"""``contextdeque window-bench``: ``contextdeque.eval.window_bench`` on the command line (a table,
or one JSON object with ``--json``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from ..eval.window_bench import run_window_bench
from .model_spec import MODEL_HELP, add_threads_argument, load_backend
from .window_options import add_bench_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_arguments(parser, runs=7, runs_help="timed runs per measurement (median reported)", chunks=4,
                        chunks_help="chunks in the window", chunk_tokens=512)
    parser.add_argument(
        "--model", default=None,
        help=MODEL_HELP,
    )
    add_threads_argument(parser)
    parser.add_argument("--no-steps", action="store_true", help="skip the per-step re-read table")
    parser.add_argument("--step-policies", default="eager,latency,default",
                        help="policies for the per-step table (default: the window's defaults, anticipation on; "
                             "any other name runs with anticipate=False, name+anticipate with anticipate=True, "
                             "name+keep with cascade_policy=keep)")
    parser.add_argument("--steps", default=None,
                        help="per-step table: which steps, comma-separated (default: all of slide, recall, "
                             "recall-valid, look-back, reorder, fork+reorder, append)")
    parser.add_argument("--no-idle", action="store_true",
                        help="per-step table: no heal() while its window is built (what a miss costs)")
    parser.add_argument("--and-no-idle", action="store_true",
                        help="per-step table: then the same steps with no idle time (what a miss costs; latency-first "
                             "policies only), sharing the re-prefill references")
    parser.add_argument("--no-healer", action="store_true", help="skip the idle healer's interference probe")
    parser.add_argument("--append-chunks", type=int, default=8,
                        help="append-only flow vs a prefix cache: chunks appended (0 skips it)")
    parser.add_argument("--append-policies", default="eager,latency", help="policies for the append-only flow")
    parser.add_argument("--append-only", action="store_true", help="run only the append-only flow")
    parser.add_argument("--idle-use", default=None, metavar="KINDS",
                        help="run only the idle-use table: the agents' generated traces (comma list of doc, web, video; "
                             "--seeds) on a latency-first window healed at every step, anticipation off and on: what "
                             "anticipation formed that no step used (contextdeque.replay.idle_use)")
    parser.add_argument("--seeds", default="0", help="with --idle-use: trace seeds (comma list)")
    parser.add_argument("--miss", action="store_true",
                        help="run only the miss table: what a recall miss costs per miss path (blind, rank-m patch, "
                             "layer-sparse patch, shallow recompute) and the dependent tail of a look-back "
                             "(contextdeque.eval.miss_bench)")


def run(args: argparse.Namespace) -> int:
    policies = () if args.no_steps else tuple(p.strip() for p in args.step_policies.split(",") if p.strip())
    backend = load_backend(args.model, threads=args.threads)
    if args.append_only:
        return _append_only(args, backend)
    if args.miss:
        return _miss(args, backend)
    if args.idle_use:
        return _idle_use(args, backend)
    result = run_window_bench(
        backend, n_chunks=args.chunks, chunk_tokens=args.chunk_tokens, runs=args.runs,
        policy=args.patch_policy, rank=args.rank, step_policies=policies, step_idle=not args.no_idle,
        healer=not args.no_healer, step_miss=args.and_no_idle,
        progress=lambda what: print(f"window-bench: {what}", file=sys.stderr, flush=True),
        step_names=None if args.steps is None else tuple(s.strip() for s in args.steps.split(",") if s.strip()),
    )
    steps, healer = result["steps"], result["healer"]
    flow = []
    if args.append_chunks > 0:
        from ..eval.append_flow import run_append_flow
        from ..eval.window_bench import _chunks

        flow = run_append_flow(
            backend, _chunks(backend, args.append_chunks, args.chunk_tokens),
            policies=tuple(p.strip() for p in args.append_policies.split(",") if p.strip()), rank=args.rank,
        )
    if args.json:
        print(json.dumps({**result, "steps": [r.as_dict() for r in steps], "append_flow": [r.as_dict() for r in flow]},
                         sort_keys=True))
        return 0
    print(f"window-bench: {result['model']} on {result['device']} ({result['threads']} threads), "
          f"{result['window']} tokens, policy={args.patch_policy}, rank={args.rank}, median of {result['runs']}")
    rows = [
        ("build (4 appends)", f"{result['build_s'] * 1000:.1f} ms", f"{result['build_forwards']} forwards"),
        ("slide(1)", f"{result['slide_ms']:.3f} ms",
         f"{result['slide_forwards']} forwards, {result['slide_pages_written']} pages re-placed"),
        ("fork()", f"{result['fork_ms']:.3f} ms",
         f"{result['fork_bytes_copied']} B copied, {result['fork_bytes_moved']} B moved"),
        ("child slide(1)", "", f"child then owns {result['fork_bytes_copied_after_child_slide']} B of its own pages"),
        ("materialize()", f"{result['materialize_ms']:.3f} ms", "fresh DynamicCache"),
        ("re-prefill (1 forward)", f"{result['reprefill_ms']:.1f} ms", "for scale"),
    ]
    w = max(len(r[0]) for r in rows)
    for name, val, note in rows:
        print(f"  {name:<{w}}  {val:>12}  {note}")
    if steps:
        _print_steps(steps)
    _print_flow(args, flow)
    if healer:
        print(f"  idle healer: {healer['probes']} foreground calls waited at most {healer['max_wait_ms']:.2f} ms "
              f"(median {healer['median_wait_ms']:.2f} ms) = {healer['max_wait_in_layers']:.2f} x one layer's forward "
              f"({healer['layer_forward_ms']:.2f} ms); {healer['heal_steps']} heal steps done, "
              f"{healer['heal_steps_abandoned']} abandoned to let the foreground run")
    sys.stdout.flush()
    return 0


def _append_only(args: argparse.Namespace, backend: Any) -> int:
    from ..eval.append_flow import run_append_flow
    from ..eval.window_bench import _chunks

    flow = run_append_flow(
        backend, _chunks(backend, args.append_chunks, args.chunk_tokens),
        policies=tuple(p.strip() for p in args.append_policies.split(",") if p.strip()), rank=args.rank,
    )
    if args.json:
        print(json.dumps({"model": backend.name, "device": str(backend.device), "threads": torch.get_num_threads(),
                          "append_flow": [r.as_dict() for r in flow]}, sort_keys=True))
        return 0
    print(f"window-bench --append-only: {backend.name} on {backend.device} ({torch.get_num_threads()} threads)")
    _print_flow(args, flow)
    return 0


def _idle_use(args: argparse.Namespace, backend: Any) -> int:
    from ..replay.idle_use import idle_use_table
    from ..traces import generate

    traces = [generate(kind.strip(), seed=int(seed)) for kind in args.idle_use.split(",") if kind.strip()
              for seed in args.seeds.split(",")]
    trained = backend.layout.max_trained_position
    beyond = trained is not None and trained < 8192  # tiny test models: the counts only, past their short context
    rows = idle_use_table(backend, traces, window_options={"beyond_trained": beyond})
    if args.json:
        print(json.dumps({"model": backend.name, "threads": torch.get_num_threads(), "idle_use": [r.as_dict() for r in rows]}))
        return 0
    print(f"window-bench --idle-use: {backend.name} on {backend.device} ({torch.get_num_threads()} threads); "
          "latency-first window, heal() at every step; extra = anticipation's work beyond the heal's")
    for off, on in zip(rows[::2], rows[1::2]):
        print(f"  {on.trace:<10} forwards {off.forwards:>5} -> {on.forwards:>5} (extra {on.forwards - off.forwards:>5}), "
              f"tokens {off.tokens:>7} -> {on.tokens:>7} (extra {on.tokens - off.tokens:>7}); anticipated patches "
              f"formed {sum(on.formed.values()):>4}, placements served {on.served:>4}; hit rate "
              f"{off.hit_rate if off.hit_rate is not None else float('nan'):.2f} -> "
              f"{on.hit_rate if on.hit_rate is not None else float('nan'):.2f}")
    return 0


def _miss(args: argparse.Namespace, backend: Any) -> int:
    from ..eval.miss_bench import run_miss_bench
    from ..eval.window_bench import _chunks, _question

    rows = run_miss_bench(backend, _chunks(backend, args.chunks + 1, args.chunk_tokens), _question(backend),
                          rank=args.rank, runs=args.runs)
    if args.json:
        print(json.dumps({"model": backend.name, "device": str(backend.device), "threads": torch.get_num_threads(),
                          "miss": [r.as_dict() for r in rows]}, sort_keys=True))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"recall misses: {backend.name} on {backend.device} ({torch.get_num_threads()} threads), "
                        f"{args.chunks}x{args.chunk_tokens} tokens, median of {args.runs}")
    for col in ("scenario", "arm", "forwards", "critical ms", "patch KiB", "KL answer", "η"):
        table.add_column(col, justify="left" if col in ("scenario", "arm") else "right")
    for r in rows:
        table.add_row(r.scenario, r.arm, f"{r.forwards:.2f}", f"{r.critical_ms:.0f}", f"{r.patch_kib:.0f}",
                      f"{r.kl_answer:.2e}", "-" if r.eta is None else f"{r.eta:.3f}")
    Console(width=160).print(table)
    return 0


def _print_flow(args: argparse.Namespace, flow: list[Any]) -> None:
    for r in flow:
        print(f"  append-only flow, {r.appends} x {args.chunk_tokens} tokens, policy={r.policy}: "
              f"{r.forwards_per_append:g} forwards/append vs prefix cache {r.prefix_forwards_per_append:g} "
              f"(x{r.forward_ratio:.2f}); {r.ms_per_append:.1f} ms vs {r.prefix_ms_per_append:.1f} ms per append "
              f"(x{r.wall_ratio:.2f}, median of appends 2..{r.appends}; the first ran {r.first_forwards})")


def _print_steps(steps: list[Any]) -> None:
    for idle in (True, False):
        rows = [r for r in steps if r.idle == idle]
        if rows:
            _print_step_table(rows, "heal() before each step (idle time)" if idle else "no idle time (a miss)")


def _print_step_table(steps: list[Any], when: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"re-read steps, {when}: step + first answer token vs re-prefill and prefix cache of the same window")
    for col in ("policy", "step", "fwd", "step ms", "floor ms", "TTFT ms", "re-prefill ms", "x re-prefill",
                "prefix-cache ms", "x prefix", "KL answer", "KL healed", "KL vs eager", "heal ms", "served", "placed"):
        table.add_column(col, justify="right" if col not in ("policy", "step") else "left")
    for r in steps:
        table.add_row(
            r.policy, r.step, str(r.forwards), f"{r.step_ms:.2f}", f"{r.floor_ms:.2f}", f"{r.ttft_ms:.0f}",
            f"{r.reprefill_ms:.0f}", f"{r.vs_reprefill:.1f}", f"{r.prefix_cache_ms:.0f}", f"{r.vs_prefix_cache:.1f}",
            f"{r.kl_answer:.2e}", f"{r.kl_healed:.2e}", "-" if r.kl_vs_eager is None else f"{r.kl_vs_eager:.1e}",
            f"{r.heal_ms:.0f}", r.served or "-", r.placed or "-",
        )
    Console(width=240).print(table)
