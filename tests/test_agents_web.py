"""WebAgent against the real pydoc HTTP server (started and stopped by the harness): pages become
text through inscriptis, links through lxml; a sliding window of pages over a growing transcript;
revisits are recalls, never re-encodes; bad input leaves the window unchanged."""

from __future__ import annotations

import socket
from urllib.parse import urljoin

import pytest

from contextdeque.agents.base import AgentConfig
from contextdeque.agents.web import PydocServer, WebAgent, fetch_page
from contextdeque.model.hf import HFBackend
from contextdeque.model.testing import build_tiny_model
from contextdeque.core.errors import BudgetError, ContentTypeError, FetchError
from contextdeque.traces import read_trace
from helpers import assert_rereads_anticipated, replay_agent_trace, spy_expect


@pytest.fixture(scope="module")
def server():
    with PydocServer() as srv:
        yield srv
    assert srv.proc is None


@pytest.fixture(scope="module")
def chat_backend(default_backend) -> HFBackend:
    model = build_tiny_model("llama", vocab_size=default_backend.tokenizer.vocab_size + 17, seed=7)
    return HFBackend(model, default_backend.tokenizer, name="tiny-llama-web")


def test_fetch_extracts_text_and_links(server):
    import httpx

    with httpx.Client(timeout=10) as c:
        page = fetch_page(c, urljoin(server.url, "topics.html"))
    assert "ASSERTION" in page.text and "<" not in page.text
    assert any("topic?key=ASSERTION" in u for u in page.links)
    assert all(u.startswith(server.url) for u in page.links)


def test_tour_slides_pages_and_recalls_revisits(chat_backend, server, tmp_path, capsys, one_thread, monkeypatch):
    expected = spy_expect(monkeypatch)
    cfg = AgentConfig(budget_tokens=520, rank=8, max_new_tokens=6)
    with WebAgent(chat_backend, cfg, pages_in_window=2, max_page_tokens=120) as agent:
        run = agent.tour(server.url, topics=3)
    visits = [s for s in run.steps if s.op == "visit"]
    assert len(visits) == 7
    revisits = [s for s in visits if "revisit" in s.detail]
    assert revisits and all(s.encodes == 0 for s in revisits)  # recalled, not re-encoded
    # a revisit is expected while the page loads: its recall runs no forward on the critical path
    assert len(expected) == sum(1 for s in revisits for r in s.receipts if r.op == "recall")
    assert_rereads_anticipated(revisits, "visit")
    assert all(any(n.startswith("page load") for n in s.notes) for s in revisits)
    assert all(sum(1 for lab in s.window if lab.startswith("page")) <= 2 for s in run.steps)
    assert any(lab.startswith("note") for lab in run.steps[-1].window)  # the transcript grows
    asked = [s for s in visits if s.question]
    assert len(asked) == 4 and all(s.kl is not None and s.reprefill_tokens for s in asked)
    trace = read_trace(run.write_trace(tmp_path / "web.jsonl"))
    ops = [e.op for e in trace.events]
    assert trace.header.generator == "web" and "recall" in ops and "evict" in ops
    replay_agent_trace(tmp_path / "web.jsonl", capsys)  # the recorded trace replays


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_bad_pages_leave_the_window_unchanged(chat_backend, server, one_thread):
    cfg = AgentConfig(budget_tokens=200, rank=4, max_new_tokens=2)
    with WebAgent(chat_backend, cfg, max_page_tokens=100) as agent:
        agent.visit(urljoin(server.url, "topics.html"))
        before = (agent.run.window.refs, agent.run.window.generation, len(agent.run.steps))
        with pytest.raises(FetchError):
            agent.visit(f"http://127.0.0.1:{_closed_port()}/")  # unreachable
        with pytest.raises(ContentTypeError):
            agent.visit(urljoin(server.url, "pydoc_data/_pydoc.css"))  # not HTML
        assert (agent.run.window.refs, agent.run.window.generation, len(agent.run.steps)) == before
    with WebAgent(chat_backend, cfg, max_page_tokens=None) as agent:
        with pytest.raises(BudgetError):
            agent.visit(server.url)  # the module index is far larger than the window
        assert len(agent.run.window) == 0 and not agent.run.steps
    assert issubclass(FetchError, OSError) and issubclass(ContentTypeError, ValueError)


@pytest.mark.slow
def test_demo_web_agent_on_the_default_model(capsys, tmp_path, one_thread):
    import json

    from contextdeque.cli import main

    assert main(["demo", "--agent", "web", "--json", "--topics", "1", "--max-new-tokens", "6",
                 "--trace", str(tmp_path / "web.jsonl")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["agent"] == "web" and out["queries"] == 2 and len(out["question_kl"]) == 2
    assert len(out["answers"]) == 2
    assert read_trace(out["trace"]).header.generator == "web"
    replay_agent_trace(out["trace"], capsys)  # the default model's trace replays too
