"""DocAgent: a document larger than the window, read page by page (skim, filter, drop, re-read),
on a tiny model with the default tokenizer and on the default model; plain text and PDF input;
bad input refused before the window is touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from contextdeque.agents.base import AgentConfig
from contextdeque.agents.scenarios import DOC_QUESTIONS, demo_document
from contextdeque.agents.doc import DocAgent, load_pages, paginate
from contextdeque.model.hf import HFBackend
from contextdeque.model.testing import build_tiny_model
from contextdeque.core.errors import BudgetError, MediaError, MediaTypeError
from contextdeque.traces import read_trace
from helpers import assert_rereads_anticipated, replay_agent_trace, spy_expect


@pytest.fixture(scope="module")
def chat_backend(default_backend) -> HFBackend:
    model = build_tiny_model("llama", vocab_size=default_backend.tokenizer.vocab_size + 17, seed=5)
    return HFBackend(model, default_backend.tokenizer, name="tiny-llama-doc")


def check_run(run, pages, budget):
    steps = run.steps
    reads = [s for s in steps if s.op == "read"]
    queries = [s for s in steps if s.op == "query"]
    # every page encoded at most once: in its read step, or (latency-first default, a page after
    # others: one conditioned forward in the step) never, unless something re-reads it elsewhere
    assert len(reads) == len(pages) and all(s.encodes <= 1 for s in reads)
    assert sum(p.n_tokens for p in pages) > budget  # the window is smaller than the document
    for s in queries:  # a re-read never encodes; the answer is measured against a re-prefill
        assert s.encodes == 0
        assert s.reprefill_tokens and s.prefix_cache_tokens is not None and s.kl is not None
        assert s.answer is not None
    assert run.window.tokens_used <= budget
    summary = run.summary()
    assert summary["queries"] == len(queries) + len(reads) and summary["encodes"] <= len(pages)
    assert all(s.answer in ("yes", "no") for s in reads)  # the model judged every page
    assert summary["prefill_avoided_vs_reprefill"] is not None
    # the total is the steps' tokens plus the idle healing before them, row by row (the demo's table)
    assert summary["tokens_prefilled"] == sum(s.tokens + s.idle_tokens for s in steps)
    assert summary["idle_heal"]["tokens"] == sum(s.idle_tokens for s in steps)
    return summary


def test_doc_agent_on_a_tiny_model(chat_backend, tmp_path, capsys, one_thread, monkeypatch):
    expected = spy_expect(monkeypatch)
    cfg = AgentConfig(budget_tokens=400, rank=8, max_new_tokens=4)
    agent = DocAgent(chat_backend, cfg, page_tokens=120)
    run = agent.answer(demo_document(("pass", "break", "global", "nonlocal", "continue", "del")), list(DOC_QUESTIONS))
    check_run(run, agent.pages, cfg.budget_tokens)
    # the agent said which pages it would re-read, the idle time before the step prepared them:
    # the re-reads ran no forward on the critical path (the query's own is the step's only one)
    recalled = [ref for s in run.steps for r in s.receipts if r.op == "recall" for ref in r.refs]
    assert recalled and set(recalled) <= {ref for group, _ in expected for ref in group}
    assert_rereads_anticipated(run.steps, "query")
    assert all(s.forwards == 1 for s in run.steps if s.op == "query")
    # each page was read ahead in the idle time before its step: the step's append ran no forward
    reads = [s for s in run.steps if s.op == "read"]
    assert all(s.forwards == 1 and s.idle_forwards >= 1 for s in reads)
    assert all(r.forwards == 0 and not r.deferred for s in reads for r in s.receipts if r.op == "append")
    drops = [s for s in run.steps if s.op == "drop"]
    assert drops and all(any(r.op == "is_disposable" for r in s.receipts) for s in drops)  # the model decided
    path = run.write_trace(tmp_path / "doc.jsonl")
    trace = read_trace(path)  # validated whole, as replay reads it
    ops = [e.op for e in trace.events]
    assert trace.header.generator == "doc" and ops.count("arrive") == len(agent.pages)
    assert "recall" in ops and "query" in ops and "slide" in ops
    replay_agent_trace(path, capsys)  # the recorded trace replays under every placement x arm


def test_exact_policy_answers_equal_a_reprefill(chat_backend, one_thread):
    cfg = AgentConfig(budget_tokens=300, patch_policy="exact", max_new_tokens=2)
    agent = DocAgent(chat_backend, cfg, page_tokens=100, disposable_tests=1)
    run = agent.answer(demo_document(("pass", "break", "global")), list(DOC_QUESTIONS[:2]))
    assert all(s.kl <= 1e-4 for s in run.steps if s.kl is not None)


def test_pdf_input(chat_backend, tmp_path, one_thread):
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("helvetica", size=10)
    for key in ("pass", "break", "global"):
        pdf.add_page()
        from pydoc_data.topics import topics

        text = topics[key].encode("latin-1", "replace").decode("latin-1")
        pdf.multi_cell(0, 5, text[:900])
    path = tmp_path / "topics.pdf"
    pdf.output(str(path))
    pages = load_pages(path, chat_backend, 120)
    assert len(pages) == 3 and "pass" in pages[0].text and "break" in pages[1].text
    agent = DocAgent(chat_backend, AgentConfig(budget_tokens=500, rank=8, max_new_tokens=2))
    run = agent.answer(path, [DOC_QUESTIONS[1]])
    assert run.steps[-1].answer is not None and "p2" in run.steps[-1].window


def test_bad_documents_are_refused_before_reading(chat_backend, tmp_path):
    agent = DocAgent(chat_backend, AgentConfig(budget_tokens=64))
    big = ["word " * 200]
    with pytest.raises(BudgetError, match="p1"):
        agent.answer(big, ["q?"])
    assert agent.run is None  # nothing was read
    not_pdf = tmp_path / "x.pdf"
    not_pdf.write_bytes(b"this is not a pdf")
    with pytest.raises(MediaError):
        agent.answer(not_pdf, ["q?"])
    with pytest.raises(MediaError):
        agent.answer(Path(tmp_path / "missing.txt"), ["q?"])
    with pytest.raises(MediaTypeError):
        agent.answer(42, ["q?"])
    with pytest.raises(ValueError):
        agent.answer("text", [])


def test_paginate_keeps_pages_within_the_size(chat_backend):
    pages = paginate(demo_document(), chat_backend, 160)
    assert len(pages) > 8 and all(p.n_tokens <= 160 + 12 for p in pages)


@pytest.mark.slow
def test_doc_agent_on_the_default_model(default_backend, one_thread):
    cfg = AgentConfig(budget_tokens=480, max_new_tokens=12)
    agent = DocAgent(default_backend, cfg, page_tokens=150)
    run = agent.answer(demo_document(("pass", "break", "global", "nonlocal", "continue")), list(DOC_QUESTIONS[:2]))
    summary = check_run(run, agent.pages, cfg.budget_tokens)
    assert summary["tokens_prefilled"] > 0 and all(a["answer"] for a in summary["answers"])


@pytest.mark.slow
def test_demo_command_runs_and_reports(tmp_path, capsys, one_thread):
    """`contextdeque demo` on the default model (a short configuration: 3 sections, 2 questions);
    the real default invocation is the README's main job."""
    import json

    from contextdeque.cli import main

    trace = tmp_path / "demo.jsonl"
    assert main(["demo", "--json", "--topics", "4", "--questions", "2", "--max-new-tokens", "8",
                 "--budget", "400", "--trace", str(trace)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["agent"] == "doc" and out["trace"] == str(trace) and trace.exists()
    assert out["queries"] >= 2 and len(out["question_kl"]) == 2 and len(out["answers"]) == 2
    for key in ("prefill_avoided_vs_reprefill", "prefill_avoided_vs_prefix_cache", "ttft_speedup_median"):
        assert isinstance(out[key], float)
    assert out["reprefill_tokens"] > 0 and out["tokens_prefilled"] > 0
    replay_agent_trace(trace, capsys)  # the default model's trace replays
    assert main(["demo", "--topics", "2", "--questions", "1", "--max-new-tokens", "4", "--budget", "300",
                 "--no-measure", "--trace", str(tmp_path / "b.jsonl")]) == 0
    text = capsys.readouterr().out
    assert "summary" in text and "prefill" in text and "replay trace:" in text and text.count("verdict:") == 1


def test_the_doc_agent_uses_its_measured_rank_unless_told(chat_backend):
    """AgentConfig(rank=None) is the agent's own default: the DocAgent's measured DOC_RANK, the
    others' DEFAULT_RANK (the demo's --rank default too); a rank the config names is honoured."""
    from contextdeque.agents.doc import DOC_RANK
    from contextdeque.agents.scenarios import default_rank
    from contextdeque.window import DEFAULT_RANK

    assert DOC_RANK > DEFAULT_RANK
    agent = DocAgent(chat_backend, AgentConfig(budget_tokens=300, max_new_tokens=1, measure=False))
    assert agent.config.rank == DOC_RANK
    run = agent.answer(["first page of text about pass.", "second page about break."], ["What does pass do?"])
    assert run.window._ctx.rank == DOC_RANK and run.summary()["rank"] == DOC_RANK
    assert DocAgent(chat_backend, AgentConfig(rank=8)).config.rank == 8
    assert AgentConfig().window_config().rank == DEFAULT_RANK  # an AgentRun of no agent: the window's default
    assert (default_rank("doc"), default_rank("web"), default_rank("video")) == (DOC_RANK, DEFAULT_RANK, DEFAULT_RANK)


@pytest.mark.slow
def test_doc_rank_keeps_the_first_questions_window_within_the_demo_floor(default_backend, one_thread):
    """The arrangement the demo's first question is answered on (the front page, two survivors and
    the recalled page, each patched on what precedes it: what the eager policy and a healed,
    anticipated latency-first window hold) at the DocAgent's rank answers within the issue's 5e-3
    nats of a re-prefill at the next token; at rank 32 it did not (6.6e-3)."""
    from contextdeque.agents.base import query_ids
    from contextdeque.agents.doc import DOC_RANK
    from contextdeque.agents.measure import reprefill_first_token, window_first_token
    from contextdeque.core.metrics import kl_divergence
    from contextdeque.window import ContextWindow

    pages = {p.label: p for p in paginate(demo_document(), default_backend, 160)}
    q = query_ids(default_backend, DOC_QUESTIONS[0])
    win = ContextWindow(default_backend, budget_tokens=640, rank=DOC_RANK, patch_policy="eager")
    for label in ("p15", "p16", "p17", "p3"):
        win.append(token_ids=list(pages[label].token_ids))
    assert [len(s.stack) for s in win._state.slots] == [0, 1, 1, 1]  # three patched pages behind the front one
    kl = kl_divergence(reprefill_first_token(win, q).logits, window_first_token(win, q).logits)
    assert kl <= 5e-3
