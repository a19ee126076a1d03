"""Eviction policies for the fast tier the replay models (the device KV pool): which unpinned
entry leaves first when a new one does not fit. One small class per file, registered in
``EVICTION_POLICIES`` by subclassing :class:`PoolEvictionPolicy` (the style of patch, placement and
reuse-arm policies).

``lru`` (online), ``reuse-distance`` (online: predicted next use from each key's own past
reuse distances) and ``belady`` (offline: knows every future access; Belady's MIN for equal sizes,
a size-aware variant for unequal ones — the yardstick, see ``eviction_belady``).

A policy sees accesses as ``touch(key, size, i)`` with ``i`` the access's index in the run's
access sequence; an offline policy is first given the whole sequence (``prepare``).
"""

from __future__ import annotations

from typing import ClassVar, Hashable, Sequence

from ..core.errors import ContextDequeError
from ..core.registry import Registered, Registry

EVICTION_POLICIES: Registry["PoolEvictionPolicy"] = Registry("eviction policy")

INF = float("inf")


class PoolEvictionPolicy(Registered):
    """An online (or, with ``offline``, trace-knowing) replacement policy over the replay's device
    pool. Not the stores' ``contextdeque.stores.EvictionPolicy``, which orders a real tier's
    evictable entries by their stats when a write needs room: this one is told every access."""

    registry = EVICTION_POLICIES
    name: ClassVar[str] = ""
    offline: ClassVar[bool] = False

    def prepare(self, accesses: Sequence[Hashable]) -> None:
        """Offline policies: the whole access sequence of the run, before it starts."""

    def touch(self, key: Hashable, size: int, i: int) -> None:
        raise NotImplementedError

    def remove(self, key: Hashable) -> None:
        raise NotImplementedError

    def victim(self, pinned: "set[Hashable] | dict") -> Hashable | None:
        """The resident, unpinned key to evict next (None: everything left is pinned)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def make_eviction(spec: "str | PoolEvictionPolicy") -> PoolEvictionPolicy:
    return EVICTION_POLICIES.make(spec, instance_of=PoolEvictionPolicy, error=PolicyError)


class PolicyError(ContextDequeError, ValueError):
    """An unknown or misconfigured replay policy (placement, eviction or reuse arm)."""
