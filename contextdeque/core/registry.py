"""The one registration style of contextdeque: a class names itself and is registered.

Every pluggable concept (patch kinds, reuse arms, patch / placement / eviction policies, KV
selectors, reuse cost rules, store tiers and store eviction policies) has a base class that
derives from :class:`Registered` and owns a :class:`Registry`. A new variant is one small class
in its own file that sets the base's key attribute (``name``, or ``kind`` for store tiers, whose
instances have a ``name`` of their own); defining the class registers it. The package's
``__init__`` imports each variant's file, so importing the package fills the registry.

A variant that lives in a higher layer than its family's base (the placement scheduler's
``"valid"`` and ``"scheduler"`` placements, defined in ``contextdeque.scheduler`` over the
window's ``PlacementPolicy``) is named with its home in the registry's ``homes``: the lower layer
never imports it, and looking the name up imports the home then, so what a name means does not
depend on what the process happened to import before.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar, Generic, Iterator, Mapping, TypeVar

T = TypeVar("T")


class Registry(dict[str, type[T]], Generic[T]):
    """Classes by registered name, filled as they are defined (see :class:`Registered`).

    ``homes``: ``name -> module`` for variants defined in a module the registry's own layer may
    not import (a higher layer). Looking such a name up (``in``, ``[]``, ``get``, :meth:`make`)
    imports its home first; listing the registry (iteration, ``len``, ``keys`` / ``values`` /
    ``items``) imports every home first. So a registry answers the same whatever was imported."""

    def __init__(self, what: str, homes: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.what = what
        self.homes: dict[str, str] = dict(homes or {})

    def _load(self, name: Any) -> None:
        """Import the home of ``name`` if it has one and is not registered yet (a home being
        imported right now is in ``sys.modules`` already: its import is not re-entered)."""
        home = self.homes.get(name) if isinstance(name, str) else None
        if home is not None and not dict.__contains__(self, name):
            importlib.import_module(home)

    def _load_all(self) -> None:
        for name in self.homes:
            self._load(name)

    def __contains__(self, name: object) -> bool:
        self._load(name)
        return dict.__contains__(self, name)

    def __missing__(self, name: str) -> type[T]:
        self._load(name)
        if dict.__contains__(self, name):
            return dict.__getitem__(self, name)
        raise KeyError(name)

    def get(self, name: str, default: Any = None) -> Any:
        self._load(name)
        return dict.get(self, name, default)

    def __iter__(self) -> Iterator[str]:
        self._load_all()
        return dict.__iter__(self)

    def __len__(self) -> int:
        self._load_all()
        return dict.__len__(self)

    def keys(self):  # type: ignore[override]
        self._load_all()
        return dict.keys(self)

    def values(self):  # type: ignore[override]
        self._load_all()
        return dict.values(self)

    def items(self):  # type: ignore[override]
        self._load_all()
        return dict.items(self)

    def add(self, name: str, cls: type[T]) -> None:
        """Register ``cls`` under ``name``; another class under a taken name is refused (the same
        class defined again, e.g. on a module reload, replaces its older self), and so is a class
        defined outside the home ``homes`` names for it (the name would not be found there)."""
        home = self.homes.get(name)
        if home is not None and not (cls.__module__ == home or cls.__module__.startswith(home + ".")):
            raise ValueError(f"{self.what} {name!r} is declared to live in {home}, not {cls.__module__}")
        old = dict.get(self, name)
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
