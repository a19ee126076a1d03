"""WindowState: a window's own mutable part (its order, overlay, evicted set, graph).

Everything in it is immutable or cheap to copy: slots are immutable records sharing their
canonicals and pages, so ``copy()`` is O(slots + graph edges) and copies no tensor bytes. An
operation works on a copy and the window swaps it in only when the operation succeeded, so a
failed operation leaves the window exactly as it was.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..core.errors import ArgumentTypeError, UnknownRefError, WindowError
from ..core.chunk import Chunk
from .graph import ConditioningGraph
from .pending import Pending, PendingWork
from .ref import ChunkRef
from .slot import Slot, Tag
from .store import WindowStore


@dataclass(frozen=True)
class EvictedEntry:
    """What a window remembers of an evicted chunk: where its canonical is, and the patches it
    carried when it left (kept in the store, reported, never replayed on recall)."""

    ref: ChunkRef
    chunk_key: str
    chunk_id: str
    n_tokens: int
    span: int
    stale_patch_keys: tuple[str, ...]
    formed_on: tuple[Tag, ...]
    provisional: "Chunk | None" = None  # (sessions saved before ``unhealed``) the provisional chunk
    # what re-encodes the canonical should the store lose it or hold a corrupt copy: the chunk's
    # inputs (token_ids / embeds, rel_positions, span, modality), no KV
    source: "dict | None" = None
    # evicted before healing: the canonical was never computed, recall or heal encodes it from
    # ``source`` (the provisional KV is not kept: nothing reads it, and it is a whole page)
    unhealed: bool = False

    @property
    def owes_encode(self) -> bool:
        """Left before its canonical was computed (latency-first): recall or heal encodes it once."""
        return self.unhealed or self.provisional is not None


@dataclass
class WindowState:
    """``pending``: the work a latency-first policy left for the heal, per ref (``window.pending``;
    as a mapping, the in-window slots whose conditioning is queued: see ``policy_latency``); the
    slots themselves hold the KV (``Slot.provisional``), the evicted entries what a recall owes."""

    slots: tuple[Slot, ...] = ()
    evicted: dict[ChunkRef, EvictedEntry] = field(default_factory=dict)
    graph: ConditioningGraph = field(default_factory=ConditioningGraph)
    generation: int = 0
    pending: PendingWork[ChunkRef] = field(default_factory=PendingWork)

    def copy(self) -> "WindowState":
        return WindowState(self.slots, dict(self.evicted), self.graph.copy(), self.generation, self.pending.copy())

    def settle_pending(
        self,
        deferred: dict[ChunkRef, str | None],
        reconditioned: set[ChunkRef],
        carried: dict[ChunkRef, tuple[Tag, ...]] | None = None,
    ) -> None:
        """After an operation: forget slots that left or were re-conditioned, queue the deferred
        ones (keeping the reason and carried conditioning of a slot already queued:
        ``PendingWork.settle``)."""
        self.pending.settle((s.ref for s in self.slots), self.generation, deferred, reconditioned, carried)

    @property
    def refs(self) -> tuple[ChunkRef, ...]:
        return tuple(s.ref for s in self.slots)

    @property
    def tokens_used(self) -> int:
        return sum(s.n_tokens for s in self.slots)

    def index(self, ref: ChunkRef) -> int:
        """Position of ``ref`` in the window; raises if it is evicted or unknown."""
        for i, s in enumerate(self.slots):
            if s.ref == ref:
                return i
        if ref in self.evicted:
            raise WindowError(f"{ref!r} is evicted, not in the window (recall it first)")
        raise UnknownRefError(f"{ref!r} is not known to this window (never appended here, or purged)")

    def check_known(self, ref: ChunkRef) -> None:
        if not isinstance(ref, ChunkRef):
            raise ArgumentTypeError(f"ref must be a ChunkRef (from append or window.refs), got {type(ref).__name__}")
        if ref not in self.evicted and all(s.ref != ref for s in self.slots):
            raise UnknownRefError(f"{ref!r} is not known to this window (never appended here, or purged)")

    def held_keys(self) -> Counter[str]:
        """Store keys the slots hold (canonicals and patches), with multiplicity."""
        c: Counter[str] = Counter()
        for s in self.slots:
            if not s.provisional:  # a provisional slot's chunk is not in the store
                c[WindowStore.chunk_key(s.chunk)] += 1
            for cond in s.stack:
                if cond.key:
                    c[cond.key] += 1
        return c
