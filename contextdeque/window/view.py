"""A human view of a window: ``ContextWindow.show()`` / ``table()`` as a ``rich`` table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .staleness import staleness
from .store import WindowStore

if TYPE_CHECKING:  # pragma: no cover
    from .window import ContextWindow


def _conditioning(slot: Any) -> str:
    if slot.provisional:
        return "own forward"  # exact where it sits; flagged "canonical pending"
    if not slot.stack:
        return "blind"
    return " + ".join(f"{c.patch.kind}@{c.patch.rank_k}" + (" (reused)" if c.reused else "") for c in slot.stack)


# (header, justify, wraps): short headers that are never cut (each column at least its header's
# width); the free-text columns wrap, the figures never do, so the table reads at 80 columns
_COLUMNS = (("#", "right", False), ("ref", "left", False), ("label", "left", True), ("span", "left", False),
            ("tokens", "right", False), ("patch", "left", True), ("stale", "right", False),
            ("tier", "left", False), ("flags", "left", True))


def window_table(win: "ContextWindow") -> Any:
    """Columns: index, ref, label, span (positions ``[start, end)``), tokens, patch (the
    conditioning: kind@rank, blind, or the chunk's own forward), staleness, tier (of the
    canonical), flags (stale / pending heal). Evicted chunks follow, with their tier."""
    from rich import box
    from rich.table import Table

    state = win._state
    store = win.store
    b = "" if win.budget_tokens is None else f" / {win.budget_tokens}"
    table = Table(
        title=f"ContextWindow: {len(state.slots)} chunks, {state.tokens_used}{b} tokens, "
              f"{len(state.evicted)} evicted, root {win.context.root_len} tokens, policy {win.policy.name}",
        title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1), pad_edge=False, collapse_padding=True,
    )
    for col, justify, wraps in _COLUMNS:
        table.add_column(col, justify=justify, min_width=len(col), no_wrap=not wraps,
                         overflow="fold" if col == "label" else "ellipsis")  # a label is never cut
    for i, s in enumerate(state.slots):
        tier = "-" if s.provisional else (store.tier_of(WindowStore.chunk_key(s.chunk)) or "not stored")
        flags = ", ".join(f for f, on in (("stale", s.stale), ("canonical pending", s.provisional),
                                               ("pending heal", s.ref in state.pending)) if on)
        table.add_row(
            str(i), f"#{s.ref.key}", s.ref.label or "", f"[{s.start}, {s.end})", str(s.n_tokens),
            _conditioning(s), f"{staleness(s, state.slots[:i]):.2f}", tier, flags,
        )
    for ref, e in state.evicted.items():
        tier = store.tier_of(e.chunk_key) or ("rebuildable" if e.source is not None else "gone")
        table.add_row("-", f"#{ref.key}", ref.label or "", "evicted", str(e.n_tokens), "-", "-", tier, "evicted")
    return table
