"""Least-recently-used eviction."""

from __future__ import annotations

from collections.abc import Sequence

from contextdeque.stores.base import EntryStat
from contextdeque.stores.policy import EvictionPolicy, by_recency


class LRUPolicy(EvictionPolicy):
    """Evict the least recently used entry first (ties broken by key, for determinism)."""

    name = "lru"

    def order(self, candidates: Sequence[EntryStat]) -> list[str]:
        return [s.key for s in by_recency(candidates)]
