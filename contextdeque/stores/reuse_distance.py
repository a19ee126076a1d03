"""Reuse-distance aware: evict the entry whose *predicted* next use is farthest away.

Each key's next use is predicted as its last access plus its last observed reuse distance (the
accesses between its two latest uses). A key used only once has no reuse distance and is
predicted never to return: such one-shot entries leave first, oldest first — the scan resistance
of LRU-2 / LIRS-style policies — and among reused keys the one due farthest ahead leaves first.
It learns from `touch` (the replay's access sequence); entries it was never told of leave first,
least recently used first.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from contextdeque.stores.base import EntryStat
from contextdeque.stores.policy import EvictionPolicy

NEVER = 1 << 62


class ReuseDistancePolicy(EvictionPolicy):
    name = "reuse-distance"

    def __init__(self) -> None:
        self._last: dict[Hashable, int] = {}
        self._predicted: dict[Hashable, int] = {}

    def touch(self, key: Hashable, nbytes: int, i: int) -> None:
        last = self._last.get(key)
        # one-shot: "never", the older ones farther
        self._predicted[key] = NEVER - i if last is None else i + (i - last)
        self._last[key] = i

    def order(self, candidates: Sequence[EntryStat]) -> list[str]:
        unknown = NEVER + 1
        return [s.key for s in sorted(candidates, key=lambda s: (-self._predicted.get(s.key, unknown), s.last_used, s.key))]
