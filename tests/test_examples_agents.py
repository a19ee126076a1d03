"""The agent examples run (on a tiny model sharing the default tokenizer where the default model
would be slow)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from contextdeque.model.hf import HFBackend
from contextdeque.model.testing import build_tiny_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def chat_backend(default_backend) -> HFBackend:
    model = build_tiny_model("llama", vocab_size=default_backend.tokenizer.vocab_size + 17, seed=9)
    return HFBackend(model, default_backend.tokenizer, name="tiny-llama-example")


def test_chat_messages_example(chat_backend, capsys, one_thread):
    mw = load("chat_messages").main(chat_backend, max_new_tokens=4)
    out = capsys.readouterr().out
    assert "came back: recalled, 0 re-encodes" in out
    assert mw.stats["returned"] == 1 and mw.stats["returned_encodes"] == 0


def test_doc_agent_example(chat_backend, capsys, tmp_path, one_thread):
    run = load("doc_agent").main(chat_backend, max_new_tokens=3, out_dir=tmp_path)
    out = capsys.readouterr().out
    assert "prefill avoided vs re-prefill" in out and (tmp_path / "doc.jsonl").exists()
    assert any(s.op == "query" and s.encodes == 0 for s in run.steps)


def test_web_agent_example(chat_backend, capsys, tmp_path, one_thread):
    run = load("web_agent").main(chat_backend, max_new_tokens=3, out_dir=tmp_path)
    out = capsys.readouterr().out
    assert "pydoc serving at http://127.0.0.1:" in out and (tmp_path / "web.jsonl").exists()
    revisits = [s for s in run.steps if "revisit" in s.detail]
    assert len(revisits) == 2 and all(s.encodes == 0 for s in revisits)  # recalled, not re-encoded


def test_video_agent_example(chat_backend, capsys, tmp_path, one_thread):
    agent = load("video_agent").main(chat_backend, max_new_tokens=3, out_dir=tmp_path)
    out = capsys.readouterr().out
    assert "0 tower runs in look-backs" in out and (tmp_path / "video.jsonl").exists()
    assert agent.summary()["frame_recalls"] > 0


def test_operator_walkthrough_example(default_backend, capsys, one_thread):
    """The walkthrough on the default model: the rank-m patch closes most of the blind gap, the
    full-rank patch equals the re-prefill."""
    kls = load("operator_walkthrough").main(default_backend, max_new_tokens=4)
    out = capsys.readouterr().out
    assert "answer (patched cache)" in out
    assert kls["full-rank patch"] <= 1e-4 < kls["blind (relocated only)"]
    assert kls["rank-8 patch"] < kls["blind (relocated only)"] / 10


def test_sliding_window_example(default_backend, capsys, one_thread):
    window = load("sliding_window").main(default_backend, max_new_tokens=4)
    out = capsys.readouterr().out
    assert "recall(assert)" in out and "answer:" in out
    recalls = [r for r in window.receipts if r.op == "recall"]
    assert len(recalls) == 1 and recalls[0].encodes == 0  # recalled, never re-encoded
