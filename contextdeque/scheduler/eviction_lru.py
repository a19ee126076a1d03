"""Least recently used: the entry untouched for longest leaves first."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from .eviction import PoolEvictionPolicy


class LRUEviction(PoolEvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, key: Hashable, size: int, i: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, pinned) -> Hashable | None:
        for k in self._order:
            if k not in pinned:
                return k
        return None
