"""Tiered, content-addressed storage of tensor bundles (device -> host -> disk).

Sits below the window layer: imports only torch, safetensors, filelock, the standard
library and `contextdeque.errors`. A new tier or eviction policy is one file registering
itself (`register_tier` / `register_policy`) plus one import line here.
"""

from contextdeque.stores.base import (
    EntryStat,
    Evicted,
    PutResult,
    StoreEntry,
    StoreKey,
    Tier,
    antecedent_signature,
    chunk_key,
    embeds_key,
    patch_key,
)
from contextdeque.stores.policy import EvictionPolicy
from contextdeque.stores.registry import POLICIES, TIERS, make_policy, make_tier, register_policy, register_tier
from contextdeque.stores.traffic import TierTraffic

# Built-in policies and tiers register themselves on import.
from contextdeque.stores.lru import LRUPolicy
from contextdeque.stores.priority import PriorityPolicy
from contextdeque.stores.memory import MemoryTier
from contextdeque.stores.host import HostTier
from contextdeque.stores.disk import DiskTier
from contextdeque.stores.tiered import TieredStore

__all__ = [
    "POLICIES",
    "TIERS",
    "DiskTier",
    "EntryStat",
    "Evicted",
    "EvictionPolicy",
    "HostTier",
    "LRUPolicy",
    "MemoryTier",
    "PriorityPolicy",
    "PutResult",
    "StoreEntry",
    "StoreKey",
    "Tier",
    "TierTraffic",
    "TieredStore",
    "antecedent_signature",
    "chunk_key",
    "embeds_key",
    "make_policy",
    "make_tier",
    "patch_key",
    "register_policy",
    "register_tier",
]
