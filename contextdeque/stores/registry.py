"""Registries of store tiers and eviction policies.

A new tier or eviction policy is one small class in its own file, decorated with
`register_tier` / `register_policy` and imported by ``contextdeque/stores/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from contextdeque.stores.base import Tier
    from contextdeque.stores.policy import EvictionPolicy

TIERS: dict[str, type[Tier]] = {}
"""Registered tier classes by name (``"memory"``, ``"host"``, ``"disk"``, ...)."""

POLICIES: dict[str, type[EvictionPolicy]] = {}
"""Registered eviction policy classes by name (``"lru"``, ``"priority"``, ...)."""

_T = TypeVar("_T")


def _register(table: dict[str, Any], what: str, name: str) -> Callable[[_T], _T]:
    def deco(cls: _T) -> _T:
        if name in table and table[name] is not cls:
            raise ValueError(f"{what} {name!r} is already registered to {table[name].__name__}")
        table[name] = cls
        cls.name = name  # type: ignore[attr-defined]
        return cls

    return deco


def register_tier(name: str) -> Callable[[_T], _T]:
    """Class decorator: register a `Tier` subclass under ``name`` (sets ``cls.kind``)."""

    def deco(cls: _T) -> _T:
        if name in TIERS and TIERS[name] is not cls:
            raise ValueError(f"tier {name!r} is already registered to {TIERS[name].__name__}")
        TIERS[name] = cls  # type: ignore[assignment]
        cls.kind = name  # type: ignore[attr-defined]
        return cls

    return deco


def register_policy(name: str) -> Callable[[_T], _T]:
    """Class decorator: register an `EvictionPolicy` subclass under ``name`` (sets ``cls.name``)."""
    return _register(POLICIES, "eviction policy", name)


def make_policy(spec: str | EvictionPolicy) -> EvictionPolicy:
    """An eviction policy instance from its registered name, or the instance itself."""
    from contextdeque.stores.policy import EvictionPolicy

    if isinstance(spec, EvictionPolicy):
        return spec
    if isinstance(spec, str) and spec in POLICIES:
        return POLICIES[spec]()
    raise ValueError(f"unknown eviction policy {spec!r}; registered: {sorted(POLICIES)}")


def make_tier(kind: str, /, **kwargs: Any) -> Tier:
    """A tier instance from its registered name, e.g. ``make_tier("disk", path=..., budget_bytes=...)``."""
    if kind not in TIERS:
        raise ValueError(f"unknown store tier {kind!r}; registered: {sorted(TIERS)}")
    return TIERS[kind](**kwargs)
