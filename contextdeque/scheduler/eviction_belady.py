"""Belady's offline optimum (MIN), size-aware: the yardstick online policies are measured against.

Knowing every future access, evict the resident whose next use is farthest away (never = first).
For equal-size entries and a miss-count cost this is optimal (Belady 1966; tested against every
online policy here). For unequal sizes the optimal offline policy is NP-hard; this uses the
standard size-aware variant: among the ``window`` residents with the farthest next uses it evicts
the one with the largest ``size x distance`` (bytes-time freed), which reduces to MIN when sizes
are equal. It is a yardstick, not a proven optimum, for variable sizes.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Sequence

from .eviction import PoolEvictionPolicy

NEVER = 1 << 62


class BeladyEviction(PoolEvictionPolicy):
    name = "belady"
    offline = True

    def __init__(self, window: int = 8) -> None:
        self.window = int(window)
        self._next: list[int] = []
        self._due: dict[Hashable, int] = {}
        self._size: dict[Hashable, int] = {}
        self._now = 0
        self._heap: list[tuple[int, int, Hashable]] = []  # (-next use, access index, key)

    def prepare(self, accesses: Sequence[Hashable]) -> None:
        nxt = [NEVER] * len(accesses)
        seen: dict[Hashable, int] = {}
        for i in range(len(accesses) - 1, -1, -1):
            k = accesses[i]
            nxt[i] = seen.get(k, NEVER)
            seen[k] = i
        self._next = nxt

    def touch(self, key: Hashable, size: int, i: int) -> None:
        due = self._next[i] if i < len(self._next) else NEVER
        self._now = i
        self._due[key] = due
        self._size[key] = size
        heapq.heappush(self._heap, (-due, i, key))

    def remove(self, key: Hashable) -> None:
        self._due.pop(key, None)

    def victim(self, pinned) -> Hashable | None:
        cands: list[tuple[Hashable, int]] = []
        held = []
        while self._heap and len(cands) < self.window:
            entry = heapq.heappop(self._heap)
            negdue, _, key = entry
            if self._due.get(key) != -negdue:
                continue  # stale entry (touched again, or removed)
            held.append(entry)
            if key not in pinned:
                cands.append((key, -negdue))
        for h in held:
            heapq.heappush(self._heap, h)
        if not cands:
            return None
        first = cands[0][0]
        if all(self._size[k] == self._size[first] for k, _ in cands):
            return first  # equal sizes: MIN exactly
        return max(cands, key=lambda kd: (self._size[kd[0]] * (kd[1] - self._now), -cands.index(kd)))[0]
