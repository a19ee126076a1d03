"""``contextdeque loadtest``: ``contextdeque.serve.loadtest`` on the command line (a summary, or
one JSON object with ``--json``; exit status 1 when any request failed)."""

from __future__ import annotations

import argparse
import json
import os

from ..serve.loadtest import plot, run_loadtest


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", action="append", required=True, help="a replica's base URL (repeat for several)")
    p.add_argument("--model", default=None, help="model name (default: the first replica's)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--conversations", type=int, default=None, help="default: one per client")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--doc-words", type=int, default=60, help="words of tool output per user turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--think-ms", type=float, default=0.0, help="pause between a client's turns (tool time): idle time a server heals in")
    p.add_argument("--failover", action="store_true", help="retry a failed request on the next replica")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--api-key-env", default="CONTEXTDEQUE_API_KEY", help="environment variable holding the API key")
    p.add_argument("--responses", default=None, help="write every reply here (JSON)")
    p.add_argument("--plot", default=None, help="write a PNG: TTFT per turn, latency over time")
    p.add_argument("--baseline", default=None, help="a previous --json report to draw beside this run")
    p.add_argument("--json", action="store_true", help="print the report as JSON (without the samples)")


def run(args: argparse.Namespace) -> int:
    if args.plot:
        import matplotlib  # noqa: F401  (the plot extra: named now, not after the run)
    rep = run_loadtest(
        args.url, model=args.model, clients=args.clients, conversations=args.conversations, turns=args.turns,
        max_tokens=args.max_tokens, seed=args.seed, api_key=os.environ.get(args.api_key_env) or None,
        failover=args.failover, timeout=args.timeout, doc_words=args.doc_words, think_s=args.think_ms / 1000.0,
    )
    if args.responses:
        with open(args.responses, "w") as f:
            json.dump(rep["replies"], f, indent=1)
    if args.plot:
        base = None
        if args.baseline:
            with open(args.baseline) as f:
                base = json.load(f)
        plot(rep, args.plot, base)
    if args.json:
        print(json.dumps({k: v for k, v in rep.items() if k != "samples"}))
        return 0 if rep["total"]["errors"] == 0 else 1
    t = rep["total"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f} ms"

    print(f"{rep['model']}: {t['requests']} requests in {rep['wall_s']:.1f} s, {t['errors']} errors, {t['failovers']} failovers")
    print(f"  throughput {t['throughput_rps']:.2f} req/s, {t['completion_tokens_per_s']:.1f} completion tok/s")
    print(f"  latency p50 {ms(t['latency_p50_s'])} p99 {ms(t['latency_p99_s'])}; TTFT p50 {ms(t['ttft_p50_s'])} p99 {ms(t['ttft_p99_s'])}")
    if t["tokens_prefilled"] is not None:
        print(f"  prompt tokens {t['prompt_tokens']}, prefilled {t['tokens_prefilled']} (avoided {t['prefill_avoided']}), encodes {t['encodes']}")
    for u, r in rep["by_replica"].items():
        print(f"  {u}: {r['ok']}/{r['requests']} ok, TTFT p50 {ms(r['ttft_p50_s'])}, latency p99 {ms(r['latency_p99_s'])}")
    print("  TTFT per turn: " + ", ".join(f"{int(k) + 1}: {ms(v['ttft_mean_s'])}" for k, v in rep["by_turn"].items()))
    for e in rep["errors"]:
        print(f"  error: {e}")
    return 0 if t["errors"] == 0 else 1
