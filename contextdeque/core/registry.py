"""The one registration style of contextdeque: a class names itself and is registered.

Every pluggable concept (patch kinds, reuse arms, patch / placement / eviction policies, KV
selectors, reuse cost rules, store tiers and store eviction policies) has a base class that
derives from :class:`Registered` and owns a :class:`Registry`. A new variant is one small class
in its own file that sets the base's key attribute (``name``, or ``kind`` for store tiers, whose
instances have a ``name`` of their own); defining the class registers it. The package's
``__init__`` imports each variant's file, so importing the package fills the registry.
"""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar

T = TypeVar("T")


class Registry(dict[str, type[T]], Generic[T]):
    """Classes by registered name, filled as they are defined (see :class:`Registered`)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def add(self, name: str, cls: type[T]) -> None:
        """Register ``cls`` under ``name``; another class under a taken name is refused (the same
        class defined again, e.g. on a module reload, replaces its older self)."""
        old = self.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"{self.what} {name!r} is already registered to {old.__module__}.{old.__qualname__}")
        self[name] = cls

    def make(self, spec: Any, /, *, instance_of: type | None = None, error: type[Exception] = ValueError, **options: Any) -> T:
        """An instance of the class registered under the name ``spec``, built with ``options``; or
        ``spec`` itself when it already is an ``instance_of`` the family's base.

        Raises:
            error: ``spec`` is neither (the message lists the registered names)."""
        if instance_of is not None and isinstance(spec, instance_of):
            return spec
        if isinstance(spec, str) and spec in self:
            return self[spec](**options)
        raise error(f"unknown {self.what} {spec!r}; registered: {', '.join(sorted(self))}")


class Registered:
    """Base of a registered class family. The family's base sets ``registry`` (a
    :class:`Registry`) and, if not ``name``, ``registry_key``; every subclass below it that sets
    that attribute itself (to a non-empty string) is registered under it when it is defined. The
    family's base (the class that sets ``registry``) is never registered."""

    registry: ClassVar[Registry[Any]]
    registry_key: ClassVar[str] = "name"

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "registry" in cls.__dict__:
            return
        key = cls.__dict__.get(cls.registry_key)
        if isinstance(key, str) and key:
            cls.registry.add(key, cls)
