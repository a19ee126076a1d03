"""`contextdeque demo`'s output rendered from fixed run records (no model): recorded by
`contextdeque demo --json` (doc, video and web agents, SmolLM2-135M, one thread, this machine) and
rendered at COLUMNS=80. The doc record's rendering is a snapshot; ``UPDATE_SNAPSHOTS=1`` rewrites
it after an intended change."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest

from contextdeque.cli.demo import QUESTION_KL, render_report

DATA = Path(__file__).resolve().parent / "data"
SNAPSHOT = DATA / "demo_doc_80.txt"


def record(agent: str) -> dict:
    return json.loads((DATA / f"demo_run_{agent}.json").read_text())


def render(rec: dict, monkeypatch) -> str:
    from rich.console import Console

    monkeypatch.setenv("COLUMNS", "80")  # what a user's 80-column terminal says
    buf = io.StringIO()
    render_report(Console(file=buf, force_terminal=False, color_system=None), rec)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


def test_doc_report_matches_its_snapshot(monkeypatch) -> None:
    text = render(record("doc"), monkeypatch)
    if os.environ.get("UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(text)
    assert text == SNAPSHOT.read_text()


@pytest.mark.parametrize("agent", ["doc", "video", "web"])
def test_the_report_fits_80_columns_and_no_number_wraps(agent: str, monkeypatch) -> None:
    rec = record(agent)
    lines = render(rec, monkeypatch).splitlines()
    assert max(len(line) for line in lines) <= 80
    for r in rec["rows"]:  # each row's numbers stand whole on the row's first line
        row = next(line for line in lines if re.match(rf"\s*{r['index']} ", line))
        cells = [f"{r['tokens']:,}"]
        if r["question"] is not None:
            cells += [f"{r['reprefill_tokens']:,}", f"{r['ms']:,.0f}", f"{r['kl']:.1e}"]
        assert all(c in row.split() for c in cells), (row, cells)


@pytest.mark.parametrize("agent", ["doc", "video", "web"])
def test_the_summary_totals_are_the_sums_of_the_rows(agent: str, monkeypatch) -> None:
    rec = record(agent)
    text = render(rec, monkeypatch)
    steps, idle = sum(r["tokens"] for r in rec["rows"]), sum(r["idle_tokens"] for r in rec["rows"])
    assert steps + idle == rec["tokens_prefilled"]  # the recorded run adds up
    reprefill = sum(r["reprefill_tokens"] or 0 for r in rec["rows"])
    total_row = next(line for line in text.splitlines() if line.split()[:1] == ["total"])
    assert total_row.split()[1:4] == [f"{steps:,}", f"{idle:,}", f"{reprefill:,}"]
    flat = " ".join(text.split())
    assert (f"contextdeque {steps:,} tokens in the steps + {idle:,} healed in idle time" in flat
            and f"= {rec['tokens_prefilled']:,} (reading included)" in flat
            and f"a re-prefill prefills {rec['reprefill_tokens']:,}" in flat)


def test_one_verdict_line_and_no_raw_ttft_lists(monkeypatch) -> None:
    rec = record("doc")
    text = render(rec, monkeypatch)
    flat = " ".join(text.split())
    assert text.count("verdict:") == 1 and "[" not in text.split("summary")[-1]
    verdict = flat.split("verdict: ")[1]
    qkl = [r["kl"] for r in rec["rows"] if r["question"] is not None and not r["choice"]]
    fresh = max(qkl) <= QUESTION_KL
    assert verdict.startswith(("fresh and fast" if fresh else "fast but not fresh") + " (")
    assert f"worst {max(qkl):.1e})" in verdict
    assert f"{rec['ttft_speedup_median']:.2f}x faster to first token" in verdict
    avoided = rec["prefill_avoided_vs_reprefill"]
    assert (f"{100 * avoided:.0f}% of its prefill tokens avoided" if avoided >= 0
            else "more prefill tokens than a re-prefill") in verdict
    assert f"worst next-token KL {rec['kl_max']:.1e} nats" in verdict
    calls, differ = rec["same_next_token"]["calls"], rec["same_next_token"]["calls"] - rec["same_next_token"]["same"]
    assert (f"differs from a full re-prefill's at {differ} of {calls} calls" if differ
            else f"the same next token as a full re-prefill at all {calls} calls") in verdict


def test_why_lines_say_why_a_run_is_slower_or_saves_little(monkeypatch) -> None:
    slow = dict(record("video"), ttft_speedup_median=0.9)  # a run slower than a re-prefill says why
    video = render(slow, monkeypatch)
    assert "why slower:" in video and "slower to first token" in video
    doc = render(record("doc"), monkeypatch)
    assert "why slower:" not in doc  # faster than a re-prefill: nothing to explain there
    assert ("why little is saved:" in doc) == (record("doc")["prefill_avoided_vs_reprefill"] < 0.25)
    little = record("web")
    assert little["prefill_avoided_vs_reprefill"] < 0.25
    text = " ".join(render(little, monkeypatch).split())
    between = sum(r["tokens"] for r in little["rows"] if r["question"] is None)
    assert (f"why little is saved: {little['queries']} model calls over {little['appended']} chunks read and only "
            f"{little['recalled']} re-read" in text and f"also paid {between:,} tokens in steps without one" in text)


@pytest.mark.parametrize("agent", ["doc", "video", "web"])
def test_fidelity_and_speed_side_by_side(agent: str, monkeypatch) -> None:
    """The summary's side-by-side block: per question and over every call, worst / median KL
    beside the median / slowest speed-up, from the rows; and how the re-reads were served."""
    import statistics

    rec = record(agent)
    flat = " ".join(render(rec, monkeypatch).split("summary")[-1].split())
    assert "fidelity and speed at answer time" in flat
    calls = [r for r in rec["rows"] if r["question"] is not None]
    kls = [r["kl"] for r in calls]
    ups = [r["reprefill_ms"] / r["ms"] for r in calls]
    assert (f"all calls ({len(calls)}) {max(kls):.1e} / {statistics.median(kls):.1e} "
            f"{statistics.median(ups):.2f}x / {min(ups):.2f}x") in flat
    re = rec["rereads"]
    if re["recalls"]:
        assert f"re-reads ({re['recalls']})" in flat and f"{re['forwards']} forwards in the step" in flat
