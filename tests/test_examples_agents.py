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
