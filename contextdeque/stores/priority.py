"""Priority-then-LRU eviction."""

from __future__ import annotations

from collections.abc import Sequence

from contextdeque.stores.base import EntryStat
from contextdeque.stores.policy import EvictionPolicy


class PriorityPolicy(EvictionPolicy):
    """Evict the lowest ``priority`` first, least recently used first within a priority.

    With every priority equal this is LRU; a higher priority (e.g. canonicals many patches
    depend on) keeps an entry until every lower-priority entry is gone.
    """

    name = "priority"
    replayed = False  # the replay's entries carry no priorities: there it would be LRU again

    def order(self, candidates: Sequence[EntryStat]) -> list[str]:
        return [s.key for s in sorted(candidates, key=lambda s: (s.priority, s.last_used, s.key))]
