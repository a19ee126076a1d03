"""PendingWork: what a latency-first window owes each chunk key until the heal (one home for both executors).

A latency-first policy answers on the critical path with a forward or a stale stand-in and leaves
the rest for the heal (``policy_latency``, ``healing``). What is left is a fact about a chunk key,
whatever executes it: the live window keys it by ``ChunkRef`` (its slots hold the KV itself:
``Slot.provisional``, ``EvictedEntry.owes_encode``), the replay by chunk id (no KV at all). Both
record it here and read it back through the same transitions:

- ``queued``: the chunk's conditioning was deferred (:class:`Pending`: why, since when, what it
  carried, whether a later operation deferred it again, whether the recall cascade forces a
  re-form); the window's ``state.pending`` (this object, as a mapping over it);
- ``entering``: admitted without a canonical and not yet forwarded (its forward comes with its
  conditioning in the same operation);
- ``forwarded``: forwarded behind this content prefix, no canonical yet: the heal computes it
  (and, where the prefix still stands, the patch is the forward's difference from it);
- ``uncanonical``: healed without a canonical (lazy canonicals): its forward's KV is exact where
  it stands, the canonical waits until something re-reads it elsewhere;
- ``canonical_due``: an uncanonical chunk whose canonical is owed by the heal (it reached the
  front, or its conditioning was cleared);
- ``departed``: left the window before its canonical was computed, which the heal still computes
  (not lazy: ``latency-shared``), in eviction order;
- ``owes``: evicted with no canonical computed (``EvictedEntry.owes_encode``): a recall encodes it.

Everything is insertion-ordered: both executors iterate it, and their orders must agree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Generic, Hashable, Iterable, Iterator, Literal, Mapping, Sequence, TypeVar


if TYPE_CHECKING:  # pragma: no cover
    from .slot import Tag

K = TypeVar("K", bound=Hashable)

HealNeed = Literal["canonical", "keep", "reforward", "recondition", "departed"]
"""What one chunk needs in a heal step (:func:`heal_need`; the ``window.plan`` ops each executes as):

- ``canonical``: a provisional chunk (a conditioned forward, no canonical yet) gets its canonical
  (``Encode``); where its forward ran after the chunks in front of it as they stand, the patch the
  eager policy wants there is that forward minus the canonical (``Difference``: no forward); then
  the eager policy decides on it as on any deferred slot (``Reuse`` of that patch, or a ``Form``);
- ``keep``: a provisional chunk appended once under lazy canonicals: its forward is exact where it
  stands, and no canonical is made until something re-reads it elsewhere (nothing);
- ``reforward``: a provisional chunk the eager policy would re-condition under lazy canonicals:
  one conditioned forward behind the chunks in front of it, healed first (``Forward``; still no
  canonical);
- ``recondition``: a chunk with a canonical whose conditioning was deferred: the eager policy's
  decision on the window as it stands, for the reason it was deferred (``Reuse`` / ``Form`` /
  ``Keep`` / ``Clear``);
- ``departed``: nothing is pending; a chunk that left before its canonical was computed gets it
  (``Encode``; lazy canonicals: never, a recall that needs one encodes it)."""


def heal_need(index: int, provisional: bool, lazy: bool, reconditions: bool) -> HealNeed:
    """What a pending chunk at window ``index`` needs (:data:`HealNeed`): ``provisional`` (its KV
    a conditioned forward with no canonical computed), ``lazy`` (the policy's lazy canonicals:
    ``latency``, not ``latency-shared``), ``reconditions`` (the eager policy would re-condition it:
    anything but an append not deferred again since). At the front a canonical is exact; without
    lazy canonicals every provisional chunk gets one."""
    if not provisional:
        return "recondition"
    if index == 0 or not lazy:
        return "canonical"
    return "reforward" if reconditions else "keep"


@dataclass(frozen=True)
class Pending:
    """A slot whose conditioning a latency-first policy deferred: ``reason`` is why the eager
    policy would have re-conditioned it (the first deferral's), ``since`` the window generation
    it was queued at, ``carried`` the antecedents its conditioning was formed on before that
    deferral (a blind stand-in carries none; the eager policy's decision depends on what the
    slot carried, e.g. an orbit patch for a pure permutation of those antecedents)."""

    reason: str | None
    since: int = 0
    carried: "tuple[Tag, ...]" = ()
    requeued: bool = False  # deferred again by a later operation (a provisional slot: moved, re-read)
    cascade: bool = False  # re-formed at the heal even where its prefix is unchanged (a recall's cascade)

    @property
    def reconditions(self) -> bool:
        """Whether the eager policy would re-condition the slot: anything but an append not
        deferred again since (:func:`heal_need`'s ``reconditions`` of a provisional slot)."""
        return not (self.reason == "append" and not self.requeued)


class PendingWork(Mapping[K, Pending], Generic[K]):
    """What is pending per chunk key (see the module doc). As a mapping: the chunks whose
    conditioning is queued (``queued``: key -> :class:`Pending`)."""

    __slots__ = ("queued", "entering", "forwarded", "uncanonical", "canonical_due", "departed", "owes")

    def __init__(self, queued: "dict[K, Pending] | None" = None) -> None:
        self.queued: dict[K, Pending] = dict(queued or {})
        self.entering: dict[K, None] = {}
        self.forwarded: dict[K, tuple[Hashable, ...]] = {}
        self.uncanonical: dict[K, None] = {}
        self.canonical_due: set[K] = set()
        self.departed: dict[K, None] = {}
        self.owes: set[K] = set()

    # ------------------------------------------------------------------ the queued mapping
    def __getitem__(self, key: K) -> Pending:
        return self.queued[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self.queued)

    def __len__(self) -> int:
        return len(self.queued)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PendingWork):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in self.__slots__)

    __hash__ = None  # type: ignore[assignment]  (mutable)

    def __repr__(self) -> str:
        parts = (f"{name}={getattr(self, name)!r}" for name in self.__slots__ if getattr(self, name))
        return f"PendingWork({', '.join(parts)})"

    def pop(self, key: K, default: "Pending | None" = None) -> "Pending | None":
        """Take ``key`` off the queue (its conditioning done, or gone)."""
        return self.queued.pop(key, default)

    def copy(self) -> "PendingWork[K]":
        """An independent copy (containers copied; the records are immutable)."""
        new: PendingWork[K] = PendingWork(self.queued)
        new.entering, new.forwarded, new.uncanonical = dict(self.entering), dict(self.forwarded), dict(self.uncanonical)
        new.canonical_due, new.departed, new.owes = set(self.canonical_due), dict(self.departed), set(self.owes)
        return new

    # ------------------------------------------------------------------ what a key owes
    def unencoded(self, key: K) -> bool:
        """Whether ``key``'s KV is a conditioned forward with no canonical computed."""
        return key in self.forwarded or key in self.uncanonical

    def provisional(self, key: K) -> bool:
        """Whether ``key`` has no canonical yet (entering, or :meth:`unencoded`): a provisional slot."""
        return key in self.entering or self.unencoded(key)

    def reconditions(self, key: K) -> bool:
        """Whether the heal re-conditions ``key`` (its conditioning queued, or its canonical owed
        at the front) rather than keeping the forward it holds."""
        return key in self.queued or key in self.canonical_due

    def heal_need(self, key: K, index: int, lazy: bool) -> HealNeed:
        """``healing.heal_need`` of ``key`` at window ``index`` from what it owes (``lazy``: the
        policy's lazy canonicals)."""
        return heal_need(index, self.unencoded(key), lazy, self.reconditions(key))

    def heal_keys(self, order: Sequence[K]) -> set[K]:
        """The keys of ``order`` (the window's) with work queued for the heal."""
        return (set(self.forwarded) | set(self.queued) | self.canonical_due) & set(order)

    def queued_work(self) -> bool:
        """Whether in-window work is queued for the heal (what makes a step heal)."""
        return bool(self.forwarded or self.queued or self.canonical_due)

    def heal_work(self) -> bool:
        """Whether the heal has anything to do: queued work or a departed chunk's canonical."""
        return self.queued_work() or bool(self.departed)

    # ------------------------------------------------------------------ transitions
    def settle(self, here: Iterable[K], generation: int, deferred: Mapping[K, str | None], reconditioned: set[K],
               carried: "Mapping[K, tuple[Tag, ...]] | None" = None) -> None:
        """After a window operation: forget queued keys that left (not in ``here``) or were
        re-conditioned, queue the ``deferred`` ones at ``generation`` (keeping the reason and
        carried conditioning of a key already queued, which is then requeued)."""
        here = set(here)
        carried = carried or {}
        queued = {k: p for k, p in self.queued.items() if k in here and k not in reconditioned}
        for key, reason in deferred.items():
            if key in here and key not in queued:
                queued[key] = Pending(reason=reason, since=generation, carried=carried.get(key, ()))
            elif key in here and not queued[key].requeued:
                queued[key] = replace(queued[key], requeued=True)
        self.queued = queued

    def defer(self, key: K, reason: str | None = None, cascade: bool = False) -> None:
        """``key``'s conditioning waits for the heal (the first deferral's ``reason`` is kept; a
        ``cascade`` re-form, once asked, stays asked)."""
        p = self.queued.get(key)
        if p is None:
            self.queued[key] = Pending(reason=reason, cascade=cascade)
        elif (p.reason is None and reason is not None) or (cascade and not p.cascade):
            self.queued[key] = replace(p, reason=p.reason if p.reason is not None else reason, cascade=p.cascade or cascade)

    def requeue(self, key: K) -> None:
        """``key`` re-conditioned at the heal on a plain decision (no cascade re-form asked)."""
        p = self.queued.get(key)
        self.queued[key] = Pending(reason=None) if p is None else replace(p, cascade=False)

    def enter(self, key: K) -> None:
        """``key`` comes in without a canonical: its forward comes with its conditioning."""
        self.entering[key] = None

    def forward(self, key: K, behind: tuple[Hashable, ...]) -> None:
        """``key`` (entering) was forwarded behind the content prefix ``behind``: canonical at the heal."""
        del self.entering[key]
        self.forwarded[key] = behind

    def take_entering(self) -> list[K]:
        """The entering keys never forwarded (a front or store-hit admission): their canonicals are needed now."""
        keys, self.entering = list(self.entering), {}
        return keys

    def take_forwarded(self, key: K) -> tuple[Hashable, ...]:
        """The content prefix ``key`` was forwarded behind, taken off (the heal decides its canonical now)."""
        return self.forwarded.pop(key)

    def keep_uncanonical(self, key: K) -> None:
        """The heal leaves ``key`` as forwarded: no canonical until something re-reads it elsewhere."""
        self.uncanonical[key] = None

    def owe_canonical(self, key: K) -> None:
        """An uncanonical ``key`` reached the front or lost its conditioning: canonical at the heal."""
        self.canonical_due.add(key)

    def forget_outside(self, order: Sequence[K]) -> set[K]:
        """Forget the canonicals owed at the front by keys not in ``order`` (the window's); returns
        the keys not in it whose conditioning or canonical is still queued (gone with a discarded
        fork: the heal drops their work)."""
        resident = set(order)
        self.canonical_due &= resident
        return {k for k in (*self.forwarded, *self.queued) if k not in resident}

    def canonicalized(self, key: K) -> None:
        """``key``'s canonical was computed: it owes none any more."""
        self.uncanonical.pop(key, None)
        self.canonical_due.discard(key)

    def take_departed(self, key: K) -> bool:
        """Whether ``key`` left owing a canonical the heal had not computed (taken off: the
        caller computes it now)."""
        return self.departed.pop(key, "x") is None

    def clear_owed(self, key: K) -> None:
        """``key`` no longer owes an encode as an evicted chunk (admitted again, or the heal
        computed its canonical)."""
        self.owes.discard(key)

    def leave(self, key: K, pinned: bool, lazy: bool) -> bool:
        """``key`` leaves the window: its queued work goes with it; left without a canonical
        computed (and not ``pinned`` by another window), it owes an encode, which the heal still
        computes unless ``lazy``. Returns whether nothing of it stays (its canonical was never
        computed, and nothing will compute it before a recall)."""
        self.queued.pop(key, None)
        self.canonical_due.discard(key)
        was_entering = self.entering.pop(key, "x") is None
        forwarded = self.forwarded.pop(key, None) is not None or self.uncanonical.pop(key, "x") is None
        if not (was_entering or forwarded) or pinned:
            return False
        self.owes.add(key)
        if forwarded and not lazy:
            self.departed[key] = None
            return False
        return True

    def restore_queue(self, before: "PendingWork[K]") -> None:
        """Put the queued conditioning and owed canonicals back as they were ``before`` (an
        operation that changed no slot queues nothing)."""
        self.queued, self.canonical_due = before.queued, before.canonical_due

    def discard_fork(self, parent: "PendingWork[K]", fork_window: Iterable[K]) -> None:
        """A fork is discarded: the parent's work as it was (``parent``, saved at the fork), less
        the canonicals the fork computed for chunks it held (``fork_window``: they stay stored);
        what the fork forwarded stays so the heal knows its canonical is never made."""
        in_fork = set(fork_window)
        self.uncanonical = {k: None for k in parent.uncanonical if k in self.uncanonical or k not in in_fork}
        self.canonical_due = {k for k in parent.canonical_due if k in self.uncanonical}
        self.queued = parent.queued
        self.forwarded = {**parent.forwarded, **{k: v for k, v in self.forwarded.items() if k not in parent.forwarded}}
        self.owes = parent.owes
