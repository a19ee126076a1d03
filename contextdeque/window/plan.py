"""The plan: a window operation's decisions as key-only operations (no tensors).

The window's policies (patch policy, placement, staleness, eviction) decide over keys; what they
decide is a list of operations, each with its inputs (the chunk's content key, its tokens, the
antecedent keys a patch is formed on, the bytes it stores and the tier they go to). Two
executors take the same operations:

- the live window (``reconcile``, ``ingest``, ``healing``) *executes* each one on its backend and
  store and records it on the operation's receipt (``Receipt.plan``);
- the offline replay (``replay/engine.py``) records the operations its key-only window decides
  and *prices* them with its cost model (``CostModel.seconds``).

What an operation costs in forwards, prefilled tokens, encodes, patches and stored bytes is
written once, here (:meth:`Op.counts`), so a plan's totals mean the same on both sides:
``tests/test_replay_matches_window.py`` holds them equal on the agents' traces.

=================  ==========================================================================
operation          what it is (forwards x tokens it prefills; bytes it stores)
=================  ==========================================================================
``Encode``         a canonical ``KV(B | root)``: one forward of B's tokens; stores the canonical
``Forward``        one forward of B's tokens after ``context`` cached tokens that keeps no
                   canonical (latency-first new content, a provisional chunk re-forwarded,
                   a query or a baseline arm's recompute); ``joined``: B ran in the forward
                   of the chunk in front of it (consecutive re-forwards: 0 forwards)
``Form``           a conditioning patch of ``kind`` on ``antecedents``: ``forwards`` conditioned
                   forwards of B's tokens (an orbit patch runs one per ordering) + the SVD;
                   stores the patch
``Difference``     a patch taken from a conditioned forward already run (latency-first heal:
                   provisional KV minus its canonical): the SVD only; stores the patch
``Reuse``          a valid patch served by the store (a hit: no forward)
``Prepared``       a provisional chunk's conditioned forward behind its new prefix, run by
                   anticipation in idle time, taken (no forward; ``window.prepared``)
``Keep``/``Clear`` a slot keeps its conditioning / drops it to its canonical (free); ``deferred``:
                   stands in for conditioning a latency-first policy queued for the heal
``Load``           a canonical read from a slower ``tier`` into the fastest one
=================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from collections.abc import Sequence as SequenceABC
from typing import Callable, Hashable, Iterable, Iterator, Sequence

from ..core.counters import Counters
from .ref import ChunkRef

Tag = tuple[ChunkRef, str]  # (antecedent ref, its version): as ``slot.Tag``

#: the counts every operation adds to (a plan's totals have exactly these keys): the fields of
#: the one counts type every receipt aggregates
COUNTS = tuple(f.name for f in dataclasses.fields(Counters))


@dataclass(frozen=True)
class Op:
    """One planned operation on chunk content ``chunk`` (its content key) of ``tokens`` tokens."""

    chunk: str
    tokens: int

    def counts(self) -> dict[str, int]:
        """What this operation adds to a plan's totals (keys of :data:`COUNTS`)."""
        return {}

    def stored(self) -> tuple[str, int] | None:
        """``(tier, bytes)`` of KV this operation writes into the store, or None."""
        return None


@dataclass(frozen=True)
class Encode(Op):
    """The canonical ``KV(B | root)``: one forward of B's tokens, stored in ``tier`` (``nbytes``
    of K and V)."""

    tier: str = "device"
    nbytes: int = 0

    def counts(self) -> dict[str, int]:
        return {"forwards": 1, "tokens_prefilled": self.tokens, "encodes": 1}

    def stored(self) -> tuple[str, int] | None:
        return (self.tier, self.nbytes)


@dataclass(frozen=True)
class Forward(Op):
    """One forward of B's tokens after ``context`` cached tokens; no canonical kept.
    ``joined``: B's tokens ran in the forward of the chunk in front of it (one forward of their
    concatenation, ``ingest.provisional_run``): its tokens, no forward (nor its fixed cost) of its own."""

    context: int = 0
    joined: bool = False

    def counts(self) -> dict[str, int]:
        return {"forwards": 0 if self.joined else 1, "tokens_prefilled": self.tokens}


@dataclass(frozen=True)
class Form(Op):
    """A ``kind`` patch of B on ``antecedents`` (content keys, window order): ``forwards``
    conditioned forwards of B's tokens after ``context`` tokens, then the SVD; stored in ``tier``
    (``nbytes`` of factors)."""

    kind: str = "exact"
    antecedents: tuple[str, ...] = ()
    forwards: int = 1
    context: int = 0
    tier: str = "device"
    nbytes: int = 0

    def counts(self) -> dict[str, int]:
        return {"forwards": self.forwards, "tokens_prefilled": self.forwards * self.tokens, "patches_formed": 1}

    def stored(self) -> tuple[str, int] | None:
        return (self.tier, self.nbytes)


@dataclass(frozen=True)
class Difference(Op):
    """A patch of B on ``antecedents`` taken from a conditioned forward already run (no forward:
    the SVD of its KV minus the canonical), stored in ``tier``."""

    antecedents: tuple[str, ...] = ()
    tier: str = "device"
    nbytes: int = 0

    def counts(self) -> dict[str, int]:
        return {"patches_formed": 1}

    def stored(self) -> tuple[str, int] | None:
        return (self.tier, self.nbytes)


@dataclass(frozen=True)
class Reuse(Op):
    """A valid ``kind`` patch of B on ``antecedents`` served by the store."""

    kind: str = "exact"
    antecedents: tuple[str, ...] = ()

    def counts(self) -> dict[str, int]:
        return {"patches_reused": 1}


@dataclass(frozen=True)
class Prepared(Op):
    """A provisional chunk's KV behind ``antecedents`` that anticipation's forward prepared,
    taken in place of the deferred re-forward (``window.prepared``): no forward."""

    antecedents: tuple[str, ...] = ()


@dataclass(frozen=True)
class Keep(Op):
    """A slot keeps its conditioning (``deferred``: in place of a patch the heal will form)."""

    deferred: bool = False


@dataclass(frozen=True)
class Clear(Op):
    """A slot drops its patches: its canonical (exact with nothing in front)."""

    deferred: bool = False


@dataclass(frozen=True)
class Load(Op):
    """A canonical (``nbytes``) read out of the slower ``tier`` into the fastest one."""

    tier: str = "host"
    nbytes: int = 0


@dataclass
class Plan:
    """An ordered list of operations (what one or more window operations decided)."""

    ops: list[Op] = field(default_factory=list)

    def add(self, op: Op) -> Op:
        self.ops.append(op)
        return op

    def extend(self, ops: Iterable[Op]) -> None:
        self.ops.extend(ops)

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def __add__(self, other: "Plan") -> "Plan":
        return Plan([*self.ops, *other.ops])

    def totals(self) -> dict[str, int]:
        """The plan's :data:`COUNTS` summed over its operations."""
        return plan_totals(self.ops)

    def stored(self) -> dict[str, int]:
        """Tier -> bytes of KV (canonicals and patches) the plan writes into the store."""
        return stored_bytes(self.ops)


def plan_totals(ops: Iterable[Op]) -> dict[str, int]:
    """:data:`COUNTS` summed over ``ops``."""
    out = dict.fromkeys(COUNTS, 0)
    for op in ops:
        for k, v in op.counts().items():
            out[k] += v
    return out


def stored_bytes(ops: Iterable[Op]) -> dict[str, int]:
    """Tier -> bytes of KV ``ops`` write into the store (canonicals encoded, patches formed)."""
    out: dict[str, int] = {}
    for op in ops:
        s = op.stored()
        if s is not None and s[1]:
            out[s[0]] = out.get(s[0], 0) + s[1]
    return out


@dataclass(frozen=True)
class ChunkKeys:
    """A chunk as a policy sees it with keys only: its content key (``id``) and ``n_tokens``."""

    id: str
    n_tokens: int


class KeySlot:
    """A slot as a patch policy sees it, with keys only (no KV): what a planner without a model
    (the replay) hands the window's own policy (``PatchPolicy.decide``) in place of a
    :class:`~.slot.Slot`. ``conditioned_on``: ``(ref, version)`` of the antecedents its
    conditioning was formed on (or a callable giving them: built only if a policy reads them);
    ``stack``: non-empty when it carries a patch."""

    __slots__ = ("ref", "chunk", "stack", "provisional", "_tags")

    def __init__(self, ref: ChunkRef, chunk: ChunkKeys, conditioned_on: "Sequence[Tag] | Callable[[], Sequence[Tag]]" = (),
                 stack: tuple[str, ...] = (), provisional: bool = False) -> None:
        self.ref, self.chunk, self.stack, self.provisional = ref, chunk, stack, provisional
        self._tags = conditioned_on

    @property
    def conditioned_on(self) -> tuple[Tag, ...]:
        if callable(self._tags):
            self._tags = tuple(self._tags())
        return tuple(self._tags)

    @property
    def n_tokens(self) -> int:
        return self.chunk.n_tokens


class KeySlots(SequenceABC):
    """``keys[:stop]`` as :class:`KeySlot` objects, each built by ``make(key)`` only when a policy
    reads it (most decisions read only whether anything is in front)."""

    def __init__(self, keys: Sequence[Hashable], make: Callable[[Hashable], KeySlot], stop: int | None = None) -> None:
        self._keys, self._make = keys, make
        self._n = len(keys) if stop is None else stop

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self._make(k) for k in self._keys[: self._n][i]]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        return self._make(self._keys[i % self._n])
