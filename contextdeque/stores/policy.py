"""Abstract eviction policy: orders a tier's evictable entries, first victim first."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from contextdeque.stores.base import EntryStat


class EvictionPolicy(ABC):
    """Decides which unpinned entries a tier evicts first.

    The tier passes only evictable entries (pinned ones and the entry being written are
    excluded) and evicts in the returned order until the new entry fits.
    """

    name: ClassVar[str] = "abstract"

    @abstractmethod
    def order(self, candidates: Sequence[EntryStat]) -> list[str]:
        """Keys of ``candidates`` in eviction order (first = evicted first)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
