"""What one session sync did and cost: the window operations it ran (:class:`MessageOp`, each
with its window receipt) and their sums beside a re-prefill and a prefix cache
(:class:`SyncReceipt`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from contextdeque.core.counters import Counters, Tally, adds
from contextdeque.window import Receipt

COUNTS = frozenset(f.name for f in dataclasses.fields(Counters))


# ---------------------------------------------------------------------------- receipts


@dataclass
class MessageOp:
    """One window operation a sync ran: ``op`` (append / evict / recall / reorder), the index of the
    message in the new list (or in the old one, for an eviction; None for a reorder), its role,
    why (``new``, ``edited-or-dropped``, ``returned``, ``moved``, ``reordered``) and the receipt."""

    op: str
    index: int | None
    role: str | None
    why: str
    receipt: Receipt

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "index": self.index, "role": self.role, "why": self.why, **self.receipt.as_dict()}


@dataclass
class SyncReceipt(Tally):
    """What one ``MessageWindow.sync`` did and cost, beside what a re-prefill and a prefix cache
    would have prefilled for the same list (root + messages; the generation prompt is prefilled by
    all three alike at ``generate``).

    Counts are of messages: ``kept`` (unchanged, no work), ``appended`` (new), ``evicted``
    (left the list; recallable), ``returned`` (came back and were recalled, never re-encoded),
    ``moved`` (recalled behind a message inserted in front of them), ``reordered`` (a
    permutation of the kept ones was applied). The window's work (``forwards``,
    ``tokens_prefilled``, ``encodes``: chunks the model encoded, ``patches_formed`` /
    ``patches_reused``) is :attr:`counters`, the ops' receipts added.
    """

    ops: list[MessageOp] = adds(list)
    messages: int = adds()
    kept: int = adds()
    appended: int = adds()
    evicted: int = adds()
    returned: int = adds()
    moved: int = adds()
    reordered: bool = False
    rebuilt: bool = False
    reprefill_tokens: int = adds()
    prefix_cache_tokens: int = adds()
    wall_ms: float = adds(0.0, json=lambda v: round(v, 3))

    @property
    def counters(self) -> Counters:
        """The window's work: the counts of the ops' receipts, added."""
        return Counters.summed(o.receipt for o in self.ops)

    def __getattr__(self, name: str) -> Any:
        if name in COUNTS:  # forwards, tokens_prefilled, ...: the summed receipts'
            return getattr(self.counters, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def returned_encodes(self) -> int:
        """Chunks encoded while recalling returning messages: always 0 (the point of recall)."""
        return sum(o.receipt.encodes for o in self.ops if o.why == "returned")

    def _derived(self) -> dict[str, Any]:
        return {**self.counters.counts(), "returned_encodes": self.returned_encodes}

    def summary(self) -> str:
        parts = [f"{n} {k}" for k, n in (("kept", self.kept), ("appended", self.appended), ("evicted", self.evicted),
                                          ("returned", self.returned), ("moved", self.moved)) if n]
        if self.reordered:
            parts.append("reordered")
        if self.rebuilt:
            parts.append("rebuilt (new root)")
        return (
            f"sync {self.messages} msgs: {', '.join(parts) or 'nothing to do'}; {self.forwards} fwd, "
            f"{self.tokens_prefilled} tok prefilled ({self.encodes} enc) vs re-prefill {self.reprefill_tokens}, "
            f"prefix cache {self.prefix_cache_tokens}; {self.wall_ms:.1f} ms"
        )
