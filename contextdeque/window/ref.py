"""ChunkRef: the handle a window hands out for one chunk occurrence."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .receipt import Receipt

# Process-wide, so a ref from one window can never alias a slot of an unrelated window.
_NEXT_KEY = itertools.count(1)


@dataclass(frozen=True)
class ChunkRef:
    """One occurrence of a chunk in a window (the same content appended twice gets two refs).

    A ref stays valid while the chunk is in the window or evicted-but-recallable; forks share
    their parent's refs. Equality and hashing use ``key`` only (``receipt`` is the receipt of
    the operation that returned this ref, for ``append``; it does not take part in equality;
    neither does ``label``, the name given with ``append(..., label=)``).
    """

    key: int
    chunk_id: str = field(compare=False)
    n_tokens: int = field(compare=False)
    label: str | None = field(default=None, compare=False)
    receipt: "Receipt | None" = field(default=None, compare=False, repr=False)

    def with_receipt(self, receipt: "Receipt") -> "ChunkRef":
        return dataclasses.replace(self, receipt=receipt)

    def __repr__(self) -> str:
        label = "" if self.label is None else f", {self.label!r}"
        return f"ChunkRef(#{self.key}{label}, {self.chunk_id[:10]}, {self.n_tokens} tok)"


def new_ref(chunk_id: str, n_tokens: int, label: str | None = None) -> ChunkRef:
    """A fresh, process-unique ref (``label``: the user's name for it, shown by ``window.show()``)."""
    return ChunkRef(key=next(_NEXT_KEY), chunk_id=chunk_id, n_tokens=int(n_tokens), label=label)
