"""Tiered, content-addressed storage of tensor bundles (device -> host -> disk).

Sits below the window layer: imports only torch, safetensors, filelock, the standard
library, `contextdeque.core.errors`, `contextdeque.core.kv`, `contextdeque.core.capsule` /
`contextdeque.core.chunk` (in `CapsuleTier`, which keeps chunks compressed at rest) and (inside `ValkeyTier`, when one is made) the ``valkey`` client. A new tier or eviction policy is one file with
one class that names itself (``kind = ...`` / ``name = ...``, see `contextdeque.core.registry`) plus
one import line here. A tier implements only its primitives (`Tier._read` / `Tier._write` of one
entry, delete, list, count, pins, and for a shared tier how a lease is taken, dropped and
renewed); `Tier` itself holds the contract: argument handling, expectations, the victims' choice
by policy, and the leases with their renewer.
"""

from contextdeque.stores.base import (
    EntryStat,
    Evicted,
    PutResult,
    StoreEntry,
    StoreKey,
    Tier,
    chunk_key,
    embeds_key,
)
from contextdeque.stores.policy import EvictionPolicy
from contextdeque.stores.registry import POLICIES, TIERS, make_policy, make_tier
from contextdeque.stores.traffic import TierTraffic

# Built-in policies and tiers register themselves on import.
from contextdeque.stores.lru import LRUPolicy
from contextdeque.stores.priority import PriorityPolicy
from contextdeque.stores.reuse_distance import ReuseDistancePolicy
from contextdeque.stores.belady import BeladyPolicy
from contextdeque.stores.memory import MemoryTier
from contextdeque.stores.host import HostTier
from contextdeque.stores.disk import DiskTier
from contextdeque.stores.valkey import ValkeyTier
from contextdeque.stores.capsule import CapsuleTier
from contextdeque.stores.tiered import TieredStore
from contextdeque.stores.keytier import KeyTier, key_stack, sized_entry
from contextdeque.stores.prefetch import Fetched, Prefetcher, fetch, settle

__all__ = [
    "POLICIES",
    "TIERS",
    "BeladyPolicy",
    "CapsuleTier",
    "DiskTier",
    "EntryStat",
    "Evicted",
    "EvictionPolicy",
    "Fetched",
    "HostTier",
    "KeyTier",
    "LRUPolicy",
    "MemoryTier",
    "Prefetcher",
    "PriorityPolicy",
    "PutResult",
    "ReuseDistancePolicy",
    "StoreEntry",
    "StoreKey",
    "Tier",
    "TierTraffic",
    "TieredStore",
    "ValkeyTier",
    "chunk_key",
    "embeds_key",
    "fetch",
    "key_stack",
    "make_policy",
    "make_tier",
    "settle",
    "sized_entry",
]
