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
    win = ContextWindow(backend, rank=2, patch_policy="eager")
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
    before, fwd, enc = state(win), backend.forwards_run, win.context.counters.encodes
    with pytest.raises(BudgetError, match="budget"):
        win.append(token_ids=[40, 41, 42])
    with pytest.raises(BudgetError, match="budget"):
        win.extend([{"token_ids": [40]}, {"token_ids": [41, 42]}])
    assert backend.forwards_run == fwd and win.context.counters.encodes == enc
    assert state(win) == before


def test_noop_operations_are_not_changes(backend):
    """The issue's reproducer: a no-op ``slide(0)`` or a same-order ``reorder`` counted as a change
    and blocked a fork's ``commit``."""
    win = ContextWindow(backend, rank=2)
    for ids in (A, B, [12, 13, 14]):
        win.append(token_ids=ids)
    child = win.fork()
    gen = win.generation
    assert "no change" in win.slide(0).notes
    win.reorder(list(win.refs))
    win.refresh()  # nothing is stale
    assert win.generation == gen
    child.slide(1)
    child.commit()  # the parent did not change since the fork
    assert len(win) == 2 and win.generation == gen + 1
    win.reorder(list(reversed(win.refs)))  # a real change still counts
    assert win.generation == gen + 2


def test_show_lists_spans_labels_conditioning_and_tiers(backend):
    import io

    from rich.console import Console

    win = ContextWindow(backend, rank=2, patch_policy="eager")
    win.append(token_ids=A, label="notes")
    win.append(token_ids=B, label="tool")
    c = win.append(token_ids=[12, 13, 14], label="old")
    win.evict(c)
    buf = io.StringIO()
    assert win.show(Console(file=buf, width=200)) is None  # prints; the table comes from table()
    out = buf.getvalue()
    assert win.table().row_count == 3
    for needle in ("tool", "notes", "old", "evicted", "[2, 6)", "[6, 9)", "exact@2", "blind", "device", "host"):
        assert needle in out, (needle, out)
    narrow = io.StringIO()  # at 80 columns no header is cut and no figure is split
    win.show(Console(file=narrow, width=80))
    lines = narrow.getvalue().splitlines()
    header = next(line for line in lines if line.lstrip().startswith("#"))
    assert header.split() == ["#", "ref", "label", "span", "tokens", "patch", "stale", "tier", "flags"]
    assert all(len(line) <= 80 for line in lines) and "[2, 6)" in narrow.getvalue() and "…" not in narrow.getvalue()


def test_text_and_chunk_template(default_backend):
    plain = ContextWindow(default_backend, rank=4)
    plain.append("Hello there.")
    plain.append("General Kenobi.")
    assert plain.text() == "Hello there.General Kenobi."  # no separator unless asked for
    assert plain.text(root=True).endswith(plain.text()) and len(plain.text(root=True)) > len(plain.text())
    sep = ContextWindow(default_backend, rank=4, chunk_template="<doc name='{label}'>\n{text}\n</doc>\n")
    sep.append("Hello there.", label="a")
    sep.append("General Kenobi.", label="b")
    assert sep.text() == "<doc name='a'>\nHello there.\n</doc>\n<doc name='b'>\nGeneral Kenobi.\n</doc>\n"


@pytest.mark.parametrize("template", ["no text here", "{text}{text}", "{txt}", 5])
def test_bad_chunk_template(backend, template):
    with pytest.raises(ContextDequeError, match="chunk_template"):
        ContextWindow(backend, chunk_template=template)


def test_window_config_is_the_one_settings_object(tiny_backend_factory):
    """Settings are checked once, where the WindowConfig is made; a window made from keywords and
    one made from the same WindowConfig carry equal settings; the config is frozen."""
    import dataclasses

    from contextdeque.core.errors import BudgetError, WindowError, WindowTypeError
    from contextdeque.window import DEFAULT_RANK, ContextWindow, WindowConfig

    backend = tiny_backend_factory("llama")
    config = WindowConfig(budget_tokens=64, rank=4, storage="bfloat16", patch_policy="eager")
    assert config.storage == torch.bfloat16 and WindowConfig().rank == DEFAULT_RANK
    by_keywords = ContextWindow(backend, budget_tokens=64, rank=4, storage=torch.bfloat16, patch_policy="eager")
    assert ContextWindow.from_config(backend, config).context.config == by_keywords.context.config == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rank = 8  # type: ignore[misc]
    assert config.replace(rank=8).rank == 8
    for bad, error in ((dict(rank=-1), WindowError), (dict(budget_tokens=0), BudgetError),
                       (dict(overflow="spill"), WindowError), (dict(storage=3), WindowTypeError)):
        with pytest.raises(error):
            WindowConfig(**bad)
        with pytest.raises(error):
            ContextWindow(backend, **bad)
    with pytest.raises(WindowTypeError):
        ContextWindow.from_config(backend, {"rank": 4})  # type: ignore[arg-type]


def test_receipts_add_their_counted_fields():
    """Receipts add (``+``, ``merged``): counts, bytes per tier, wall time, refs, notes, repairs;
    a field added to Receipt with the ``adds`` metadata is summed without listing it anywhere."""
    from contextdeque.window.receipt import ADDED_FIELDS, Receipt

    a = Receipt("append", forwards=1, tokens_prefilled=5, bytes_moved={"device": 3}, notes=("a",), left=("x",))
    b = Receipt("heal", forwards=2, encodes=1, bytes_moved={"device": 1, "host": 2}, repairs=("r",))
    total = Receipt.merged("trace", [a, b], wall_ms=7.0)
    assert (total.op, total.forwards, total.tokens_prefilled, total.encodes) == ("trace", 3, 5, 1)
    assert total.bytes_moved == {"device": 4, "host": 2} and a.bytes_moved == {"device": 3}
    assert total.notes == ("a",) and total.repairs == ("r",) and total.left == () and total.wall_ms == 7.0
    assert {"forwards", "tokens_prefilled", "bytes_moved", "wall_ms"} <= set(ADDED_FIELDS)
    assert (a + b).forwards == 3 and (a + b).op == "append"
