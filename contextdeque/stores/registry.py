"""Registries of store tiers and eviction policies.

A new tier or eviction policy is one small class in its own file that names itself (a `Tier`
subclass sets ``kind``, an `EvictionPolicy` subclass sets ``name``: the one registration style of
``contextdeque.core.registry``) and is imported by ``contextdeque/stores/__init__.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from contextdeque.core.registry import Registry

if TYPE_CHECKING:  # pragma: no cover
    from contextdeque.stores.base import Tier
    from contextdeque.stores.policy import EvictionPolicy

TIERS: Registry[Tier] = Registry("store tier")
"""Registered tier classes by name (``"memory"``, ``"host"``, ``"disk"``, ...)."""

POLICIES: Registry[EvictionPolicy] = Registry("eviction policy")
"""Registered eviction policy classes by name (``"lru"``, ``"priority"``, ...)."""


def make_policy(spec: str | EvictionPolicy) -> EvictionPolicy:
    """An eviction policy instance from its registered name, or the instance itself."""
    from contextdeque.stores.policy import EvictionPolicy

    return POLICIES.make(spec, instance_of=EvictionPolicy)


def make_tier(kind: str, /, **kwargs: Any) -> Tier:
    """A tier instance from its registered name, e.g. ``make_tier("disk", path=..., budget_bytes=...)``."""
    return TIERS.make(kind, **kwargs)
