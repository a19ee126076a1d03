"""``contextdeque demo``: an agent at work on the embedded default model, step by step.

The default (no arguments) is the DocAgent answering questions over Python's own reference text
(``pydoc_data.topics``, shipped with Python) through a window smaller than the text. A live table
shows, per step: what the window did, the forwards run, tokens prefilled by contextdeque against a
full re-prefill and a prefix cache, time to first token against a re-prefill measured side by side,
the answer, and the next-token KL against the re-prefill. Then a summary, and where the replay
trace was written. ``--agent web`` browses Python's documentation server; ``--agent video``
watches a clip built from real photographs (on a text-only model through the image-span
emulation: no visual understanding; with ``--model`` a local Qwen2-VL checkpoint, through its own
vision tower); ``--json`` prints the summary as one object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from contextdeque.agents.base import AgentConfig, Step
from contextdeque.cli.model_spec import add_threads_argument
from contextdeque.agents.scenarios import AGENTS, DOC_QUESTIONS, DOC_TOPICS, run_doc, run_video, run_web


def default_trace_path(agent: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "contextdeque" / "traces"
    return base / f"demo-{agent}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agent", choices=AGENTS, default="doc", help="which agent to run (default: doc)")
    p.add_argument("--budget", type=int, default=None, help="window budget in tokens (default: the agent's)")
    p.add_argument("--rank", type=int, default=32, help="patch rank m (default 32)")
    p.add_argument("--policy", default="default", help="patch policy: default (= latency: re-reads run no forward, healed between steps), eager, exact, none (default: default)")
    p.add_argument("--questions", type=int, default=None, help="answer only the first N questions")
    p.add_argument("--topics", type=int, default=None,
                   help="doc: use only the first N sections of the document; web: visit N topic pages (default 3)")
    p.add_argument("--segments", type=int, default=4, help="video: watch the first N segments (default 4)")
    p.add_argument("--video", default=None, help="video: a video file (default: a clip built from skimage photographs)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="answer length (default 24)")
    p.add_argument("--no-measure", action="store_true", help="skip the side-by-side re-prefill (no KL, no TTFT ratio)")
    p.add_argument("--trace", default=None, help="where to write the replay trace (default: ~/.cache/contextdeque/traces/)")
    p.add_argument("--model", default=None,
                   help="a local model path instead of the embedded default (needs a chat template; a Qwen2-VL "
                        "directory also needs its image processor), or tiny:<arch> for a tiny random-weight model "
                        "with the default tokenizer (its answers are noise)")
    p.add_argument("--placement", default="arrival", help="placement policy: arrival or scheduler (default: arrival)")
    add_threads_argument(p)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def _fmt_ms(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}"


def _table(steps: list[Step], title: str) -> Any:
    from rich.table import Table

    t = Table(title=title, show_lines=False, expand=False)
    for name, just in (("#", "right"), ("step", "left"), ("fwd", "right"), ("tokens cd", "right"),
                       ("re-prefill", "right"), ("prefix$", "right"), ("TTFT ms cd", "right"),
                       ("re-prefill", "right"), ("KL", "right"), ("answer", "left")):
        t.add_column(name, justify=just, overflow="fold")  # type: ignore[arg-type]
    for s in steps:
        what = s.detail if s.op == "query" else f"{s.op} {s.detail}"
        if s.notes:
            what += " [dim](" + "; ".join(s.notes) + ")[/dim]"
        t.add_row(
            str(s.index), what, str(s.forwards), f"{s.tokens:,}",
            "—" if s.reprefill_tokens is None else f"{s.reprefill_tokens:,}",
            "—" if s.prefix_cache_tokens is None else f"{s.prefix_cache_tokens:,}",
            _fmt_ms(s.ms) if s.question is not None else f"[dim]{s.ms:,.0f}[/dim]",
            _fmt_ms(s.reprefill_ms),
            "—" if s.kl is None else f"{s.kl:.2e}",
            "" if s.answer is None else (s.answer[:60] + ("…" if len(s.answer) > 60 else "")),
        )
    return t


def _e(x: float | None) -> str:
    return "—" if x is None else f"{x:.2e}"


def summary_lines(summary: dict[str, Any]) -> list[str]:
    def pct(x: float | None) -> str:
        return "—" if x is None else f"{100 * x:.0f}%"

    kl = ", ".join(f"{x:.2e}" for x in summary.get("question_kl", [])) or "—"
    speed = summary.get("ttft_speedup_median")
    return [
        f"prefill: contextdeque {summary['tokens_prefilled']:,} tokens (reading included) vs re-prefill "
        f"{summary['reprefill_tokens']:,} and prefix cache {summary['prefix_cache_tokens']:,} at the queries: "
        f"{pct(summary['prefill_avoided_vs_reprefill'])} avoided vs re-prefill, "
        f"{pct(summary['prefill_avoided_vs_prefix_cache'])} vs prefix cache",
        f"time to first token at the queries: median speed-up {'—' if speed is None else f'{speed:.2f}x'} vs a "
        f"re-prefill measured side by side (cd {summary['ttft_ms']} ms, re-prefill {summary['reprefill_ttft_ms']} ms)",
        f"fidelity: next-token KL vs a full re-prefill at each question: {kl} nats; over all "
        f"{summary['queries']} model calls max {_e(summary['kl_max'])}, median {_e(summary['kl_median'])} "
        f"(patch policy {summary['patch_policy']}, rank {summary['rank']})",
    ]


def video_line(summary: dict[str, Any]) -> str:
    what = "vision tower" if summary["image_path"] == "vision" else "pixel projection (image-span emulation: no visual understanding)"
    return (f"  video: {summary['frames']} frames in {summary['segments']} segments; {what} ran "
            f"{summary['tower_calls']}x; {summary['frame_recalls']} frames recalled in look-backs, "
            f"{summary['tower_calls_in_lookbacks']} tower runs there")


def run(args: argparse.Namespace) -> int:
    import torch

    from contextdeque.cli.model_spec import image_processor, load_backend

    t0 = time.perf_counter()
    backend = load_backend(args.model, chat=True, threads=args.threads)
    load_s = time.perf_counter() - t0
    config = AgentConfig(
        budget_tokens=args.budget or 640, rank=args.rank, patch_policy=args.policy,
        max_new_tokens=args.max_new_tokens, measure=not args.no_measure, placement=args.placement,
    )
    steps: list[Step] = []
    live = None
    console = None
    if not args.json:
        from rich.console import Console
        from rich.live import Live

        console = Console()
        console.print(f"[bold]contextdeque demo[/bold] — {args.agent} agent on {backend.name} "
                      f"(loaded in {load_s:.1f} s), window budget {config.budget_tokens} tokens, "
                      f"patch policy {config.patch_policy}, rank {config.rank}")
        live = Live(_table(steps, f"{args.agent} agent, step by step"), console=console, refresh_per_second=4)
        live.start()

    def on_step(st: Step) -> None:
        steps.append(st)
        if live is not None:
            live.update(_table(steps, f"{args.agent} agent, step by step"))

    t1 = time.perf_counter()
    video_agent = None
    try:
        if args.agent == "doc":
            qs = DOC_QUESTIONS[: args.questions] if args.questions else DOC_QUESTIONS
            topics = DOC_TOPICS[: args.topics] if args.topics else DOC_TOPICS
            agent_run = run_doc(backend, config, on_step, questions=qs, topics=topics)
        elif args.agent == "web":
            agent_run = run_web(backend, config, on_step, topics=args.topics or 3)
        elif args.agent == "video":
            video_agent = run_video(backend, config, on_step, segments=args.segments, video=args.video,
                                    processor=image_processor(backend, args.model))
            agent_run = video_agent.run
        else:  # pragma: no cover - argparse restricts the choices
            raise SystemExit(f"unknown agent {args.agent}")
    finally:
        if live is not None:
            live.stop()
    trace_path = agent_run.write_trace(args.trace or default_trace_path(args.agent))
    summary = video_agent.summary() if args.agent == "video" else agent_run.summary()
    summary.update({"agent": args.agent, "model": backend.name, "trace": str(trace_path),
                    "seconds": round(time.perf_counter() - t1, 2), "model_load_seconds": round(load_s, 2),
                    "threads": torch.get_num_threads()})
    if args.json:
        print(json.dumps(summary))
        return 0
    assert console is not None
    console.print()
    console.print("[bold]summary[/bold]")
    for line in summary_lines(summary):
        console.print("  " + line)
    if args.agent == "video":
        console.print(video_line(summary))
    console.print(f"  ran {summary['steps']} steps in {summary['seconds']:.1f} s ({summary['threads']} threads); "
                  f"replay trace written to {trace_path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="contextdeque demo")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
