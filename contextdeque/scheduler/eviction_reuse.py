"""Reuse-distance aware: evict the entry whose *predicted* next use is farthest away.

Each key's next use is predicted as its last access plus its last observed reuse distance (the
accesses between its two latest uses). A key used only once has no reuse distance and is
predicted never to return: such one-shot entries leave first, oldest first — the scan resistance
of LRU-2 / LIRS-style policies — and among reused keys the one due farthest ahead leaves first.
"""

from __future__ import annotations

import heapq
from typing import Hashable

from .eviction import PoolEvictionPolicy

NEVER = 1 << 62


class ReuseDistanceEviction(PoolEvictionPolicy):
    name = "reuse-distance"

    def __init__(self) -> None:
        self._last: dict[Hashable, int] = {}
        self._pred: dict[Hashable, int] = {}
        self._heap: list[tuple[int, int, int, Hashable]] = []  # (-predicted, -age tiebreak, seq, key)
        self._seq = 0

    def touch(self, key: Hashable, size: int, i: int) -> None:
        last = self._last.get(key)
        pred = NEVER - i if last is None else i + (i - last)  # one-shot: "never", older ones farther
        self._last[key] = i
        self._pred[key] = pred
        self._seq += 1
        heapq.heappush(self._heap, (-pred, self._seq, i, key))

    def remove(self, key: Hashable) -> None:
        self._pred.pop(key, None)

    def victim(self, pinned) -> Hashable | None:
        held = []
        found = None
        while self._heap:
            negp, seq, i, key = self._heap[0]
            if self._pred.get(key) != -negp or self._last.get(key) != i:
                heapq.heappop(self._heap)  # stale entry
                continue
            if key in pinned:
                held.append(heapq.heappop(self._heap))
                continue
            found = key
            break
        for h in held:
            heapq.heappush(self._heap, h)
        return found
