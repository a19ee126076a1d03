"""``contextdeque soak``: ``contextdeque.eval.soak`` on the command line: random window operations
on the default store, with the resident-memory curve (a table, or JSON with ``--json``)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..eval.soak import run_soak
from ..window.context import DEFAULT_MAX_EVICTED
from .model_spec import MODEL_HELP, add_threads_argument, load_backend
from .window_options import add_window_arguments, window_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", type=int, default=DEFAULT_MAX_EVICTED, help="operations to run (default 10000)")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop after this long even if --ops are not done")
    parser.add_argument("--budget-tokens", type=int, default=1024, help="the window's token budget")
    parser.add_argument("--section-tokens", type=int, default=100, help="tokens per appended documentation section")
    parser.add_argument("--memory-budget", default=None,
                        help="the default store's memory budget ('512MiB', '10%%'; default: $CONTEXTDEQUE_MEMORY_BUDGET or 10%% of RAM)")
    parser.add_argument("--disk-budget", default=None, help="the disk tier's budget (default: min(8 GiB, 25%% of free space))")
    parser.add_argument("--store-dir", default=None, help="disk tier directory (default: a temporary one, removed after)")
    parser.add_argument("--sample-every", type=int, default=100, help="record memory every N operations")
    parser.add_argument("--max-evicted", type=int, default=10_000,
                        help="evicted refs the window remembers (ContextWindow(max_evicted=); default %(default)s)")
    add_window_arguments(parser)
    parser.add_argument("--count-tensors", action="store_true",
                        help="also record the bytes of live tensors at each sample (a walk over Python's objects)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    add_threads_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object (curve included)")
    parser.add_argument("--progress", action="store_true", help="print each memory sample as it is taken (stderr)")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def run(args: argparse.Namespace) -> int:
    backend = load_backend(args.model, threads=args.threads)

    def progress(row: dict) -> None:
        print(json.dumps(row), file=sys.stderr, flush=True)

    r = run_soak(
        backend, ops=args.ops, config=window_config(args, budget_tokens=args.budget_tokens, max_evicted=args.max_evicted),
        section_tokens=args.section_tokens, memory_budget=args.memory_budget, disk_budget=args.disk_budget,
        store_dir=args.store_dir, seed=args.seed, sample_every=args.sample_every,
        max_seconds=None if args.max_minutes is None else 60.0 * args.max_minutes,
        progress=progress if args.progress else None, count_tensors=args.count_tensors,
    )
    if args.json:
        print(json.dumps(r, sort_keys=True))
        return 0
    print(f"soak: {r['model']} on {r['device']} ({r['threads']} threads): {r['ops']} of {r['ops_asked']} operations "
          f"in {r['seconds']} s, {r['forwards']} forwards, errors {r['errors'] or 0}")
    print(f"  operations: {r['op_counts']}")
    print(f"  memory budget {_mib(r['memory_budget'])}, model {_mib(r['model_bytes'])}; "
          f"RSS start {_mib(r['rss_start'])}, after warm-up ({r['warmup_ops']} ops) {_mib(r['rss_at_warmup'])}, "
          f"max after {_mib(r['rss_max_after_warmup'])} (+{_mib(r['growth_after_warmup'])}), end {_mib(r['rss_end'])}")
    print(f"  baseline (runtime + model, warmed) {_mib(r['rss_baseline'])}; peak above it {_mib(r['over_baseline_max'])} "
          f"of the {_mib(r['memory_budget'])} budget: {'within' if r['within_budget'] else 'OVER'}")
    print(f"  {'op':>6} {'s':>8} {'RSS':>10} {'device':>10} {'host':>10} {'disk':>10} {'evicted refs':>13}")
    for row in r["curve"]:
        st = row["store"]
        print(f"  {row['op']:>6} {row['s']:>8} {_mib(row['rss']):>10} {_mib(st.get('device', 0)):>10} "
              f"{_mib(st.get('host', 0)):>10} {_mib(st.get('disk', 0)):>10} {row['evicted_refs']:>13}")
    return 0
