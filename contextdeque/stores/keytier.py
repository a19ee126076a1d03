"""`KeyTier`: a tier over keys and sizes only, so the one tier policy runs without the bytes.

`TieredStore` is the tier policy: admission (the fastest tier that takes an entry), victims (each
tier's `EvictionPolicy`), spills (a victim goes one tier down), promotion (a hit below the top is
copied into every faster tier), demotion (`TieredStore.demote`, when a window's last holder lets
go) and the byte accounting (`TierTraffic`: reads, writes, evictions per tier). The live window
runs it over real tiers; the replay runs the very same code over key tiers (``replay/pool.py``),
whose entries are `sized_entry`: one tensor on torch's ``meta`` device, which has a shape and a
dtype but no storage, so an entry weighs its size in the budgets and nothing in memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contextdeque.stores.base import StoreEntry
from contextdeque.stores.memory import MemoryTier
from contextdeque.stores.policy import EvictionPolicy
from contextdeque.stores.tiered import TieredStore

_META = torch.device("meta")


class KeyTier(MemoryTier):
    """A `MemoryTier` of `sized_entry` entries: keys, sizes, kinds, recency, pins; no payload.

    Args:
        budget_bytes: byte budget (None: unbounded).
        policy: eviction policy name or instance.
        name: tier name used in `TierTraffic` (``device``, ``host``, ``disk``...).
    """

    kind = "keys"

    def __init__(self, budget_bytes: int | None, *, policy: str | EvictionPolicy = "lru", name: str = "device") -> None:
        super().__init__(_META, budget_bytes, policy=policy, name=name)

    def _place(self, t: torch.Tensor, copy: bool) -> torch.Tensor:
        return t  # nothing to copy: a meta tensor has no storage


def sized_entry(nbytes: int, kind: str) -> StoreEntry:
    """An entry of ``nbytes`` payload bytes (``kind``: ``chunk``, ``patch``...), allocating nothing."""
    return StoreEntry({"bytes": torch.empty(int(nbytes), dtype=torch.uint8, device=_META)}, {"kind": kind})


def key_stack(tiers: Sequence[tuple[str, int | None]], policy: str | EvictionPolicy = "lru") -> TieredStore:
    """A `TieredStore` of key tiers, fastest first: ``(name, budget_bytes)`` each; the fastest
    tier evicts by ``policy``, the others least recently used first (as `default_store`'s)."""
    return TieredStore([KeyTier(budget, policy=policy if i == 0 else "lru", name=name)
                        for i, (name, budget) in enumerate(tiers)])
