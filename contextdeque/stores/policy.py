"""Abstract eviction policy: orders a tier's evictable entries, first victim first."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
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

    @abstractmethod
    def order(self, candidates: Sequence[EntryStat]) -> list[str]:
        """Keys of ``candidates`` in eviction order (first = evicted first)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
