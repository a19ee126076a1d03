"""`TierTraffic`: bytes moved per tier by store operations (goes into window receipts)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from contextdeque.core.counters import Tally, adds, shown


def _add(d: dict[str, int], tier: str, n: int) -> None:
    d[tier] = d.get(tier, 0) + n


@dataclass
class TierTraffic(Tally):
    """Per-tier byte counts of one or more store operations.

    All byte counts are payload bytes (sum of tensor ``numel * element_size``), so they
    compare across tiers; a disk tier's budget additionally counts its file headers.

    Attributes:
        read: tier name -> bytes read out of it (a ``get`` served from it, a demotion).
        written: tier name -> bytes written into it (puts, promotions, spills, demotions).
        evicted: tier name -> bytes removed from it by its eviction policy or a demotion
            (explicit deletes are not counted).
        hits: tier name -> number of ``get`` calls served from it.
        misses: ``get`` calls no tier could serve.
        served_from: tier that served the last ``get`` recorded here (None: a miss / none).
        dropped: keys evicted with no lower tier able to take them (lost from the store).
        fallbacks: tier name -> operations that tier could not serve because it was away
            (a remote tier unreachable or timing out): reads counted as misses, writes kept
            in the local tiers only.
        fallback_reasons: tier name -> why, for the latest fallback (``"unreachable"``,
            ``"timeout"``, ``"auth"``, ``"backoff"``...).
        quarantined: ``"tier:key"`` of copies that failed verification and were set aside
            (a ``get(corrupt_ok=True)`` went on to slower tiers, or reported a miss).
    """

    read: dict[str, int] = adds(dict)
    written: dict[str, int] = adds(dict)
    evicted: dict[str, int] = adds(dict)
    hits: dict[str, int] = adds(dict)
    misses: int = adds()
    served_from: str | None = shown()
    dropped: list[str] = adds(list)
    fallbacks: dict[str, int] = adds(dict)
    fallback_reasons: dict[str, str] = adds(dict, merge=lambda mine, theirs: {**mine, **theirs})  # the latest reason
    quarantined: list[str] = adds(list)

    def add_read(self, tier: str, nbytes: int, *, hit: bool = True) -> None:
        """Record ``nbytes`` read out of ``tier``; ``hit``: it served a ``get``."""
        _add(self.read, tier, nbytes)
        if hit:
            _add(self.hits, tier, 1)
            self.served_from = tier

    def add_written(self, tier: str, nbytes: int) -> None:
        """Record ``nbytes`` written into ``tier``."""
        _add(self.written, tier, nbytes)

    def add_evicted(self, tier: str, nbytes: int) -> None:
        """Record ``nbytes`` evicted from ``tier``."""
        _add(self.evicted, tier, nbytes)

    def add_miss(self) -> None:
        """Record a ``get`` no tier could serve."""
        self.misses += 1
        self.served_from = None

    def add_fallback(self, tier: str, reason: str) -> None:
        """Record one operation ``tier`` could not serve (it is away), and why."""
        _add(self.fallbacks, tier, 1)
        self.fallback_reasons[tier] = reason

    @property
    def moved_bytes(self) -> int:
        """Total bytes read plus written over all tiers."""
        return sum(self.read.values()) + sum(self.written.values())

    def __iadd__(self, other: TierTraffic) -> TierTraffic:
        """Add ``other``'s counts into this record (in place); ``served_from`` becomes the later
        record's when it recorded a ``get``."""
        served_from = other.served_from if (other.served_from is not None or other.misses) else self.served_from
        super().__iadd__(other)
        self.served_from = served_from
        return self

    def merge(self, other: TierTraffic) -> TierTraffic:
        """Add ``other``'s counts into this record (in place) and return it."""
        self += other
        return self

    def _derived(self) -> dict[str, object]:
        return {"moved_bytes": self.moved_bytes}


# The record of the store operation running in this thread/task: a tier that is away reports
# its fallback into it (`report_fallback`), so the operation's traffic (and the receipt built
# from it) says so without every call site threading a record through.
_CURRENT: ContextVar[TierTraffic | None] = ContextVar("contextdeque_store_traffic", default=None)


@contextmanager
def recording(traffic: TierTraffic) -> Iterator[TierTraffic]:
    """Make ``traffic`` the record `report_fallback` writes into for the enclosed calls."""
    token = _CURRENT.set(traffic)
    try:
        yield traffic
    finally:
        _CURRENT.reset(token)


def report_fallback(tier: str, reason: str) -> None:
    """Called by a tier that could not serve an operation because it is away."""
    tr = _CURRENT.get()
    if tr is not None:
        tr.add_fallback(tier, reason)
