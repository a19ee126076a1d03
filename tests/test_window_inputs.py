"""Issue 10 (strict inputs, friction): user mistakes raise package errors naming the argument
(type mistakes are TypeErrors, value mistakes ValueErrors) and leave the window unchanged;
concise reprs; labels; ``overflow="error"`` refuses before encoding."""

from __future__ import annotations

import pytest
import torch
from helpers import micro_llama

from contextdeque.core.errors import ArgumentTypeError, BudgetError, ContextDequeError
from contextdeque.model.hf import HFBackend
from contextdeque.window import ContextWindow

A = [5, 6, 7, 8]
B = [9, 10, 11]


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    return HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-inputs-llama")


def state(win: ContextWindow):
    return (win.refs, win.evicted_refs, win.placement(), win.generation, win.tokens_used)


@pytest.mark.parametrize(
    "kwargs, kind, names",
    [
        ({"text": 5}, TypeError, "text"),
        ({"text": ["a", "b"]}, TypeError, "text"),
        ({"token_ids": ["a"]}, TypeError, "token_ids"),
        ({"token_ids": [1.5, 2.5]}, TypeError, "token_ids"),
        ({"token_ids": torch.tensor([1.5, 2.5])}, TypeError, "token_ids"),
        ({"token_ids": torch.tensor([[5, 6], [7, 8]])}, ValueError, "token_ids"),
        ({"token_ids": [5, 6, 10_000]}, ValueError, "token_ids"),
        ({"token_ids": [-1, 5]}, ValueError, "token_ids"),
        ({"token_ids": []}, ValueError, "token_ids"),
        ({"embeds": torch.zeros(3, 7)}, ValueError, "embeds"),
        ({"embeds": "x"}, TypeError, "embeds"),
        ({"token_ids": A, "label": 3}, TypeError, "label"),
        ({"chunk": "x"}, TypeError, "chunk"),
    ],
)
def test_append_mistakes_are_typed_and_change_nothing(backend, kwargs, kind, names):
    win = ContextWindow(backend, rank=2)
    win.append(token_ids=B)
    before = state(win)
    fwd = backend.forwards_run
    with pytest.raises(ContextDequeError) as exc:
        if "text" in kwargs:
            win.append(kwargs.pop("text"), **kwargs)
        else:
            win.append(**kwargs)
    assert isinstance(exc.value, kind), type(exc.value).__mro__
    assert names in str(exc.value)
    assert state(win) == before
    assert backend.forwards_run == fwd  # refused before any model work


def test_append_positional_int_is_a_type_error(backend):
    win = ContextWindow(backend, rank=2)
    with pytest.raises(ArgumentTypeError, match="text"):
        win.append(5)


def test_label_on_append_and_extend(backend):
    win = ContextWindow(backend, rank=2)
    ref = win.append(token_ids=A, label="system notes")
    assert ref.label == "system notes"
    assert "system notes" in repr(ref)
    rec = win.extend([{"token_ids": B, "label": "tool output"}])
    assert rec.refs[0].label == "tool output"
    assert [r.label for r in win.refs] == ["system notes", "tool output"]


def test_reprs_are_concise(backend):
    win = ContextWindow(backend, rank=2)
    win.append(token_ids=list(range(4, 40)))
    ref = win.append(token_ids=list(range(10, 50)))
    chunk, patch = win.chunk(ref), win.patches(ref)[0]
    for obj in (chunk, patch, ref, ref.receipt):
        text = repr(obj)
        assert len(text) < 200, text
        assert "tensor(" not in text
    assert chunk.id[:10] in repr(chunk) and "40 tok" in repr(chunk)
    assert patch.kind in repr(patch) and f"rank {patch.rank_k}" in repr(patch)
    assert repr(ref.receipt).startswith("Receipt(append:")


def test_overflow_error_refuses_before_encoding(backend):
    win = ContextWindow(backend, rank=2, budget_tokens=6, overflow="error")
    win.append(token_ids=A)
    before, fwd, enc = state(win), backend.forwards_run, win.context.counters["encodes"]
    with pytest.raises(BudgetError, match="budget"):
        win.append(token_ids=[40, 41, 42])
    assert backend.forwards_run == fwd and win.context.counters["encodes"] == enc
    assert state(win) == before
