"""The one eviction-policy family: orders a tier's evictable entries, first victim first.

A policy sees the candidates' stats (`EntryStat`: size, recency stamp, priority) when a write
needs room. A policy that judges by the access sequence (``reuse-distance``, the offline
``belady``) is also told every access by whoever knows that sequence (`touch`; an offline one is
first given the whole of it, `prepare`): the replay's tier stack does (``replay/pool.py``); a live
store does not, and such a policy then falls back to its stats (least recently used first).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import ClassVar

from contextdeque.core.registry import Registered
from contextdeque.stores.base import EntryStat
from contextdeque.stores.registry import POLICIES


class EvictionPolicy(ABC, Registered):
    """Decides which unpinned entries a tier evicts first.

    The tier passes only evictable entries (pinned ones and the entry being written are
    excluded) and evicts in the returned order until the new entry fits.
    """

    registry = POLICIES
    #: registry name: a subclass that sets it is registered under it (contextdeque.core.registry)
    name: ClassVar[str] = "abstract"
    #: True when the policy needs the whole access sequence first (`prepare`)
    offline: ClassVar[bool] = False
    #: offered by the replay's ``--eviction``: False for a policy that orders by what the replay's
    #: entries do not carry (its entries have no priorities)
    replayed: ClassVar[bool] = True

    @abstractmethod
    def order(self, candidates: Sequence[EntryStat]) -> list[str]:
        """Keys of ``candidates`` in eviction order (first = evicted first)."""

    def prepare(self, accesses: Sequence[Hashable]) -> None:
        """An offline policy: the run's whole access sequence, before it starts."""

    def touch(self, key: Hashable, nbytes: int, i: int) -> None:
        """Access number ``i`` (of the sequence `prepare` was given) reads or writes ``key``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def by_recency(candidates: Sequence[EntryStat]) -> list[EntryStat]:
    """``candidates`` least recently used first (ties broken by key, for determinism)."""
    return sorted(candidates, key=lambda s: (s.last_used, s.key))
