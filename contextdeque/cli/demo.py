"""``contextdeque demo``: an agent at work on the embedded default model, step by step.

The default (no arguments) is the DocAgent answering questions over Python's own reference text
(``pydoc_data.topics``, shipped with Python) through a window smaller than the text. A live table
(80 columns, with a progress bar of the side-by-side re-prefill under it) shows, per step: what
the window did, tokens prefilled by contextdeque in the step and healed in the idle time before
it, what a full re-prefill prefills at that model call, time to first token and its speed-up
against a re-prefill measured side by side, and the next-token KL against it. Then the answers, a
summary whose totals are the table's column sums, a why-line where the run was slower or saved
little, one verdict line, and where the replay trace was written (`render_report`: from the run
record alone). ``--agent web`` browses Python's documentation server; ``--agent video``
watches a clip built from real photographs (on a text-only model through the image-span
emulation: no visual understanding; with ``--model`` a local Qwen2-VL checkpoint, through its own
vision tower); ``--json`` prints the summary and every step (``rows``) as one object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from contextdeque.agents.base import AgentConfig, Step
from contextdeque.cli.model_spec import add_threads_argument
from contextdeque.cli.window_options import add_window_arguments
from contextdeque.window.receipt import PREPARED_SERVED
from contextdeque.agents.scenarios import AGENTS, DOC_QUESTIONS, DOC_TOPICS, default_rank, run_doc, run_video, run_web


def default_trace_path(agent: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "contextdeque" / "traces"
    return base / f"demo-{agent}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agent", choices=AGENTS, default="doc", help="which agent to run (default: doc)")
    p.add_argument("--budget", type=int, default=None, help="window budget in tokens (default: the agent's)")
    add_window_arguments(p, rank=None, rank_help="patch rank m (default: the agent's own: doc 64, measured for its "
                                                  "pages; web and video 32)")
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
    p.add_argument("--json", action="store_true", help="print the summary and every step (rows) as one JSON object")


def _n(x: int | None) -> str:
    return "—" if x is None else f"{x:,}"


def _e(x: float | None) -> str:
    return "—" if x is None else f"{x:.1e}"


def _speedup(rp_ms: float | None, ms: float) -> str:
    return "—" if not rp_ms or ms <= 0 else f"{rp_ms / ms:.1f}x"


def _step_text(row: dict[str, Any]) -> str:
    """What the step did (its notes and answer are in ``--json``; answers also under the table)."""
    from rich.markup import escape

    return escape(row["detail"] if row["op"] == "query" else f"{row['op']} {row['detail']}".strip())


def answer_lines(rows: list[dict[str, Any]], limit: int = 150) -> list[str]:
    """One line per free-text answer: the question's label and the answer (cut; whole in ``--json``)."""
    out = []
    for r in rows:
        if r.get("answer") is None or r.get("choice"):
            continue
        answer = " ".join(r["answer"].split())
        label = r["detail"].split(":", 1)[0] if r["op"] == "query" else f"step {r['index']}"
        out.append(f"{label} ({r['question']}) → {answer[:limit]}{'…' if len(answer) > limit else ''}")
    return out


def steps_table(rows: list[dict[str, Any]], title: str, *, totals: bool = True) -> Any:
    """The step-by-step table (rows: ``Step.as_dict()``), made to fit 80 columns: numbers never
    wrap; the step text wraps at words. ``tokens`` is what contextdeque prefilled in the step,
    ``idle`` what it healed in the idle time before it; their totals (a footer row, ``totals``)
    add up to the summary's."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 0), collapse_padding=True, show_edge=False,
              show_footer=totals and bool(rows), expand=False,
              caption="tokens: prefilled by contextdeque in the step; idle: healed before it (off the clock); "
                      "re-prefill: what a full re-prefill prefills at that model call; ms: time to first token "
                      "(dim: the step's time); KL: next-token KL vs that re-prefill (nats)",
              caption_justify="left")
    queries = [r for r in rows if r.get("question") is not None]
    ratios = [r["reprefill_ms"] / r["ms"] for r in queries if r.get("reprefill_ms") and r["ms"] > 0]
    kls = [r["kl"] for r in queries if r.get("kl") is not None]
    median = statistics.median(ratios) if ratios else None
    columns = (
        ("#", "right", ""),
        ("step", "left", "total"),
        ("tokens", "right", _n(sum(r["tokens"] for r in rows))),
        ("idle", "right", _n(sum(r.get("idle_tokens", 0) for r in rows))),
        ("re-prefill", "right", _n(sum(r["reprefill_tokens"] or 0 for r in queries))),
        ("ms", "right", ""),
        ("speed-up", "right", "—" if median is None else f"{median:.2f}x"),
        ("KL", "right", _e(max(kls)) if kls else "—"),
    )
    for name, just, footer in columns:
        if name == "step":
            t.add_column(name, justify=just, footer=footer, ratio=1, overflow="ellipsis")  # type: ignore[arg-type]
        else:
            t.add_column(name, justify=just, footer=footer, no_wrap=True)  # type: ignore[arg-type]
    for r in rows:
        query = r.get("question") is not None
        t.add_row(
            str(r["index"]), _step_text(r), _n(r["tokens"]), _n(r.get("idle_tokens", 0)) if r.get("idle_tokens") else "",
            _n(r["reprefill_tokens"]) if query else "",
            f"{r['ms']:,.0f}" if query else f"[dim]{r['ms']:,.0f}[/dim]",
            _speedup(r.get("reprefill_ms"), r["ms"]) if query else "", _e(r.get("kl")) if query else "",
        )
    return t


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{int(round(100 * x))}%"  # never "-0%"


def why_lines(summary: dict[str, Any]) -> list[str]:
    """Why a run saved little or ran slower than a re-prefill, from its own numbers."""
    out = []
    speed = summary.get("ttft_speedup_median")
    appended, recalled = summary.get("appended", 0), summary.get("recalled", 0)
    avoided = summary.get("prefill_avoided_vs_reprefill")
    if speed is not None and speed < 1:
        rows = summary.get("rows") or []
        q = [r for r in rows if r.get("question") is not None]
        after_work = [r for r in q if r["forwards"] > 1]  # forwards beyond the query's own
        out.append(
            f"why slower: at {len(after_work)} of {len(q)} model calls the step's own window work ran first, on "
            f"its clock ({sum(r['forwards'] - 1 for r in after_work)} forwards: new material encoded and patched "
            f"on what precedes it), where a re-prefill reads everything in one forward; the window is faster "
            f"where a step re-reads what it holds, not where every step brings something new")
    if avoided is not None and avoided < 0.25:
        rows = summary.get("rows") or []
        between = sum(r["tokens"] for r in rows if r.get("question") is None)
        idle = (summary.get("idle_heal") or {}).get("tokens", 0)
        out.append(
            f"why little is saved: {summary['queries']} model calls over {appended} chunks read and only "
            f"{recalled} re-read; a re-prefill pays only at a call, while contextdeque also paid {between:,} "
            f"tokens in steps without one (reading, notes) and {idle:,} healing in idle time: the saving grows "
            f"with re-reads and with questions per chunk read")
    return out


QUESTION_KL = 5e-3
"""Next-token KL (nats) against a re-prefill under which a question's answer counts as fresh: the
fidelity the eager policy's patches give (the seed paper: patched ≈ 1e-3, blind reuse 0.03-0.12)."""


def _question_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in summary.get("rows") or [] if r.get("question") is not None and not r.get("choice")]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def fidelity_speed_table(summary: dict[str, Any]) -> Any:
    """Fidelity and speed side by side (80 columns): for the free-text questions and for every
    model call, next-token KL against a re-prefill and time to first token against it; then how
    the re-reads were served (prepared in idle time or formed in the step) and what they ran on
    the critical path."""
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False, expand=False,
              title="fidelity and speed at answer time, against a full re-prefill", title_justify="left")
    t.add_column("", no_wrap=True)
    t.add_column("next-token KL: worst / median", no_wrap=True)
    t.add_column("speed-up: median / slowest", no_wrap=True)
    calls = [r for r in summary.get("rows") or [] if r.get("question") is not None]
    for label, rows in ((f"questions ({len(_question_rows(summary))})", _question_rows(summary)),
                        (f"all calls ({len(calls)})", calls)):
        kls = [r["kl"] for r in rows if r.get("kl") is not None]
        ups = [r["reprefill_ms"] / r["ms"] for r in rows if r.get("reprefill_ms") and r["ms"] > 0]
        if not rows:
            continue
        fid = "not measured" if not kls else f"{max(kls):.1e} / {_median(kls):.1e}"
        spd = "not measured" if not ups else f"{_median(ups):.2f}x / {min(ups):.2f}x"
        t.add_row(label, fid, spd)
    re = summary.get("rereads")
    if re and re["recalls"]:
        served = re["served"]
        prepared = (*PREPARED_SERVED, "canonical")  # (canonical: nothing in front, exact)
        ahead = sum(served.get(k, 0) for k in prepared)
        others = ", ".join(f"{n} {k}" for k, n in sorted(served.items()) if k not in prepared)
        t.add_row(f"re-reads ({re['recalls']})", f"{ahead} prepared ahead" + (f", {others}" if others else ""),
                  f"{re['forwards']} forwards in the step")
    return t


def verdict_line(summary: dict[str, Any]) -> str:
    """One line: fidelity and speed judged together (every question within ``QUESTION_KL`` of a
    re-prefill; faster to first token than it), then the speed-up, tokens avoided and worst KL."""
    speed = summary.get("ttft_speedup_median")
    calls = summary["queries"]
    qkl = [r["kl"] for r in _question_rows(summary) if r.get("kl") is not None]
    fresh = None if not qkl else max(qkl) <= QUESTION_KL
    fast = None if speed is None else speed >= 1
    judged = {(True, True): "fresh and fast", (True, False): "fresh but slower", (False, True): "fast but not fresh",
              (False, False): "neither fresh nor fast"}.get((fresh, fast), "not measured")
    if fresh is not None:
        judged += (f" (every question within {QUESTION_KL:.0e} nats of a re-prefill, worst {max(qkl):.1e})" if fresh
                   else f" ({sum(k > QUESTION_KL for k in qkl)} of {len(qkl)} questions beyond {QUESTION_KL:.0e} nats, "
                        f"worst {max(qkl):.1e})")
    if speed is None:
        pace = "time to first token not measured (--no-measure)"
    elif speed >= 1:
        pace = f"{speed:.2f}x faster to first token than a re-prefill (median of {calls} model calls)"
    else:
        pace = f"{1 / speed:.2f}x slower to first token than a re-prefill (median of {calls} model calls)"
    avoided = summary.get("prefill_avoided_vs_reprefill")
    tokens = ("more prefill tokens than a re-prefill" if avoided is not None and avoided < 0
              else f"{_pct(avoided)} of its prefill tokens avoided")
    same = summary.get("same_next_token")
    kl_max = summary.get("kl_max")
    if same is None or kl_max is None:
        meaning = "no fidelity measured"
    elif same["same"] == same["calls"]:
        meaning = (f"worst next-token KL {kl_max:.1e} nats, and the same next token as a full re-prefill at all "
                   f"{same['calls']} calls: the window answers as a re-prefill of the same context starts to")
    else:
        meaning = (f"worst next-token KL {kl_max:.1e} nats; the next token differs from a full re-prefill's at "
                   f"{same['calls'] - same['same']} of {same['calls']} calls (patches formed before a heal are "
                   f"approximate: --policy eager heals inside each step, --policy exact matches a re-prefill)")
    return f"verdict: {judged}: {pace}, {tokens}; {meaning}"


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary under the table: token totals (equal to the table's column sums), why-lines
    where the run saved little or ran slower, and one verdict line."""
    heal = summary.get("idle_heal") or {}
    steps_tokens = summary["tokens_prefilled"] - heal.get("tokens", 0)
    lines = [
        f"prefill: contextdeque {steps_tokens:,} tokens in the steps + {heal.get('tokens', 0):,} healed in idle time "
        f"({heal.get('ms', 0) / 1000:.1f} s off the clock) = {summary['tokens_prefilled']:,} (reading included); "
        f"at its {summary['queries']} model calls a re-prefill "
        f"prefills {summary['reprefill_tokens']:,}, a prefix cache {summary['prefix_cache_tokens']:,} "
        f"({_pct(summary['prefill_avoided_vs_reprefill'])} and {_pct(summary['prefill_avoided_vs_prefix_cache'])} avoided)",
    ]
    lines += why_lines(summary)
    lines.append(verdict_line(summary))
    return lines


def video_line(summary: dict[str, Any]) -> str:
    what = "vision tower" if summary["image_path"] == "vision" else "pixel projection (image-span emulation: no visual understanding)"
    return (f"video: {summary['frames']} frames in {summary['segments']} segments; {what} ran "
            f"{summary['tower_calls']}x; {summary['frame_recalls']} frames recalled in look-backs, "
            f"{summary['tower_calls_in_lookbacks']} tower runs there")


def render_report(console: Any, summary: dict[str, Any]) -> None:
    """The demo's output after the run, from its record alone (``summary`` with its ``rows``):
    the table, then the summary. The snapshot test renders a fixed record through this."""
    from rich.padding import Padding
    from rich.text import Text

    console.print(steps_table(summary["rows"], f"{summary['agent']} agent, step by step"))
    answers = answer_lines(summary["rows"])
    if answers:
        console.print("[bold]answers[/bold]")
        for line in answers:
            console.print(Padding(Text(line), (0, 0, 0, 2)), highlight=False)
    console.print("[bold]summary[/bold]")
    console.print(Padding(fidelity_speed_table(summary), (0, 0, 0, 2)))
    lines = summary_lines(summary)
    if summary["agent"] == "video":
        lines.insert(-1, video_line(summary))
    threads = summary["threads"]
    lines.append(f"ran {summary['steps']} steps in {summary['seconds']:.1f} s ({threads} thread{'s' if threads != 1 else ''}); "
                 f"replay trace: {summary['trace']}; every number per step: --json")
    for line in lines:
        console.print(Padding(Text(line), (0, 0, 0, 2)), highlight=False)


class _SideBySide:
    """The live display's progress bar of the side-by-side re-prefill work (a phase listener:
    ``contextdeque.agents.base.phase_listener``): calls measured and the time spent on them."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=20),
                                 TextColumn("{task.fields[detail]}"), TimeElapsedColumn())
        self.task = self.progress.add_task("re-prefill side by side", total=None, detail="waiting for the first question")
        self.calls = 0
        self.seconds = 0.0
        self._t0: float | None = None

    def __call__(self, phase: str) -> None:
        if phase == "re-prefill":
            self._t0 = time.perf_counter()
            self.progress.update(self.task, detail=f"re-prefilling for call {self.calls + 1}")
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None
            self.calls += 1
            self.progress.update(self.task, completed=self.calls,
                                 detail=f"{self.calls} calls measured, {self.seconds:.1f} s re-prefilling")


def run(args: argparse.Namespace) -> int:
    import contextlib

    import torch

    from contextdeque.agents.base import phase_listener

    from .model_spec import image_processor, load_backend

    t0 = time.perf_counter()
    backend = load_backend(args.model, chat=True, threads=args.threads)
    load_s = time.perf_counter() - t0
    config = AgentConfig(
        budget_tokens=args.budget or 640, rank=args.rank if args.rank is not None else default_rank(args.agent),
        patch_policy=args.patch_policy,
        max_new_tokens=args.max_new_tokens, measure=not args.no_measure, placement=args.placement,
    )
    rows: list[dict[str, Any]] = []
    live = None
    console = None
    side = None
    title = f"{args.agent} agent, step by step"
    if not args.json:
        from rich.console import Console, Group
        from rich.live import Live

        console = Console()
        console.print(f"[bold]contextdeque demo[/bold] — {args.agent} agent on {backend.name} "
                      f"(loaded in {load_s:.1f} s), window budget {config.budget_tokens} tokens, "
                      f"patch policy {config.patch_policy}, rank {config.rank}")
        side = _SideBySide() if config.measure else None

        def view() -> Any:
            from rich.text import Text

            # the last 12 rows while it runs (totals only in the final table, over every row)
            table = steps_table(rows[-12:], title + (f" (last 12 of {len(rows)})" if len(rows) > 12 else ""),
                                totals=len(rows) <= 12)
            last = answer_lines(rows, limit=60)[-1:]
            parts = [table, *(Text("last answer: " + a, overflow="ellipsis", no_wrap=True) for a in last)]
            return Group(*parts, *([side.progress] if side is not None else []))

        # transient: the final table (every step) is printed once the run is over
        live = Live(view(), console=console, refresh_per_second=4, transient=True)
        live.start()

    def on_step(st: Step) -> None:
        rows.append(st.as_dict())
        if live is not None:
            live.update(view())

    t1 = time.perf_counter()
    video_agent = None
    try:
        with phase_listener(side) if side is not None else contextlib.nullcontext():
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
                    "threads": torch.get_num_threads(), "rows": [s.as_dict() for s in agent_run.steps]})
    if args.json:
        print(json.dumps(summary))
        return 0
    assert console is not None
    render_report(console, summary)
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="contextdeque demo")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
