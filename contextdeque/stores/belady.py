"""Belady's offline optimum (MIN), size-aware: the yardstick online policies are measured against.

Knowing every future access, evict the resident whose next use is farthest away (never = first).
For equal-size entries and a miss-count cost this is optimal (Belady 1966; tested against every
online policy here). For unequal sizes the optimal offline policy is NP-hard; this uses the
standard size-aware variant: among the ``window`` residents with the farthest next uses it evicts
the one with the largest ``size x distance`` (bytes-time freed), which reduces to MIN when sizes
are equal. It is a yardstick, not a proven optimum, for variable sizes. It needs the access
sequence (`prepare`) and each access as it happens (`touch`): the replay's tier stack gives both.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from contextdeque.stores.base import EntryStat
from contextdeque.stores.policy import EvictionPolicy

NEVER = 1 << 62


class BeladyPolicy(EvictionPolicy):
    name = "belady"
    offline = True

    def __init__(self, window: int = 8) -> None:
        self.window = int(window)
        self._next: list[int] = []
        self._due: dict[Hashable, tuple[int, int]] = {}  # key -> (next use, index of its last access)
        self._now = 0

    def prepare(self, accesses: Sequence[Hashable]) -> None:
        nxt = [NEVER] * len(accesses)
        seen: dict[Hashable, int] = {}
        for i in range(len(accesses) - 1, -1, -1):
            k = accesses[i]
            nxt[i] = seen.get(k, NEVER)
            seen[k] = i
        self._next = nxt

    def touch(self, key: Hashable, nbytes: int, i: int) -> None:
        self._now = i
        self._due[key] = (self._next[i] if i < len(self._next) else NEVER, i)

    def order(self, candidates: Sequence[EntryStat]) -> list[str]:
        """Victim after victim: among the ``window`` remaining candidates due farthest ahead, the
        first (equal sizes: MIN exactly), else the one freeing the most ``size x distance``."""
        due = {s.key: self._due.get(s.key, (NEVER, -1)) for s in candidates}
        rest = sorted(candidates, key=lambda s: (-due[s.key][0], due[s.key][1], s.key))
        out: list[str] = []
        while rest:
            head = rest[: self.window]
            pick = 0
            if any(s.nbytes != head[0].nbytes for s in head):
                pick = max(range(len(head)), key=lambda j: (head[j].nbytes * (due[head[j].key][0] - self._now), -j))
            out.append(rest.pop(pick).key)
        return out
