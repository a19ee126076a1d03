"""What one session sync did and cost: the window operations it ran (:class:`MessageOp`, each
with its window receipt) and their sums beside a re-prefill and a prefix cache
(:class:`SyncReceipt`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from contextdeque.window import Receipt


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


def _summed(name: str) -> property:
    """A read-only total of the window receipts' ``name`` over a sync's ops."""
    return property(lambda self: sum(int(getattr(o.receipt, name)) for o in self.ops),
                    doc=f"``{name}`` summed over the window operations' receipts.")


# `SyncReceipt.as_dict`'s fields, in order (then ``wall_ms`` and ``ops``)
_AS_DICT = (
    "messages", "kept", "appended", "evicted", "returned", "moved", "reordered", "rebuilt", "forwards",
    "tokens_prefilled", "encodes", "returned_encodes", "patches_formed", "patches_reused", "reprefill_tokens",
    "prefix_cache_tokens",
)


@dataclass
class SyncReceipt:
    """What one ``MessageWindow.sync`` did and cost, beside what a re-prefill and a prefix cache
    would have prefilled for the same list (root + messages; the generation prompt is prefilled by
    all three alike at ``generate``).

    Counts are of messages: ``kept`` (unchanged, no work), ``appended`` (new), ``evicted``
    (left the list; recallable), ``returned`` (came back and were recalled, never re-encoded),
    ``moved`` (recalled behind a message inserted in front of them), ``reordered`` (a
    permutation of the kept ones was applied). ``encodes`` counts chunks the model encoded.
    """

    ops: list[MessageOp] = field(default_factory=list)
    messages: int = 0
    kept: int = 0
    appended: int = 0
    evicted: int = 0
    returned: int = 0
    moved: int = 0
    reordered: bool = False
    rebuilt: bool = False
    reprefill_tokens: int = 0
    prefix_cache_tokens: int = 0
    wall_ms: float = 0.0

    # the window's work, summed over the ops' receipts
    forwards = _summed("forwards")
    tokens_prefilled = _summed("tokens_prefilled")
    encodes = _summed("encodes")
    patches_formed = _summed("patches_formed")
    patches_reused = _summed("patches_reused")

    @property
    def returned_encodes(self) -> int:
        """Chunks encoded while recalling returning messages: always 0 (the point of recall)."""
        return sum(o.receipt.encodes for o in self.ops if o.why == "returned")

    def as_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in _AS_DICT}
        out["wall_ms"] = round(self.wall_ms, 3)
        out["ops"] = [{"op": o.op, "index": o.index, "role": o.role, "why": o.why, **o.receipt.as_dict()} for o in self.ops]
        return out

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
