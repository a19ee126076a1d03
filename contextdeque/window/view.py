"""A human view of a window: ``ContextWindow.show()`` / ``table()`` as a ``rich`` table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..patch.alloc import fidelity_report
from .staleness import staleness
from .store import WindowStore

if TYPE_CHECKING:  # pragma: no cover
    from .window import ContextWindow


def _conditioning(slot: Any) -> str:
    if slot.provisional:
        return "own forward"  # exact where it sits; flagged "canonical pending"
    if not slot.stack:
        return "blind"
    return " + ".join(f"{c.patch.kind}@{c.patch.rank_label if c.patch.per_layer else c.patch.rank_k}"
                      + _fidelity(c.patch) + (" (reused)" if c.reused else "") for c in slot.stack)


def _fidelity(patch: Any) -> str:
    """`` η≈0.981`` (the estimate under a fidelity target), `` η≈0.93 < 0.99 MISS`` when the byte
    cap could not fit the target, `` (over cap)`` when ``on_miss`` took more bytes."""
    rep = fidelity_report(patch)
    if rep is None:
        return ""
    est = rep.get("eta_est")
    text = f" η≈{est:.3f}" if est is not None else f" energy {rep['energy']:.3f}"
    if rep.get("action") == "reported":
        want = rep.get("eta_target") if est is not None else rep.get("energy_target")
        text += f" < {want:g} MISS"
    elif rep.get("shortfall"):
        text += f" ({rep['action']})"
    return text


# (header, justify, wraps): short headers that are never cut (each column at least its header's
# width); the free-text columns wrap, the figures never do, so the table reads at 80 columns
_COLUMNS = (("#", "right", False), ("ref", "left", False), ("label", "left", True), ("span", "left", False),
            ("tokens", "right", False), ("patch", "left", True), ("stale", "right", False),
            ("tier", "left", False), ("flags", "left", True))


def window_table(win: "ContextWindow") -> Any:
    """Columns: index, ref, label, span (positions ``[start, end)``), tokens, patch (the
    conditioning: kind@rank, blind, or the chunk's own forward; under a fidelity target the
    estimated η, MISS where it falls short), staleness, tier (of the canonical), flags (stale /
    canonical pending / pending heal / fidelity miss). Evicted chunks follow, with their tier."""
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
        missed = any((fidelity_report(c.patch) or {}).get("action") == "reported" for c in s.stack)
        flags = ", ".join(f for f, on in (("stale", s.stale), ("canonical pending", s.provisional),
                                          ("pending heal", s.ref in state.pending), ("fidelity miss", missed)) if on)
        table.add_row(
            str(i), f"#{s.ref.key}", s.ref.label or "", f"[{s.start}, {s.end})", str(s.n_tokens),
            _conditioning(s), f"{staleness(s, state.slots[:i]):.2f}", tier, flags,
        )
    for ref, e in state.evicted.items():
        tier = store.tier_of(e.chunk_key) or ("rebuildable" if e.source is not None else "gone")
        table.add_row("-", f"#{ref.key}", ref.label or "", "evicted", str(e.n_tokens), "-", "-", tier, "evicted")
    return table
