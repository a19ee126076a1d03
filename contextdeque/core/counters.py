"""Counters: the one counts type every cost record aggregates, added and serialized generically.

A record of what work cost (a window operation's ``Receipt``, a sync's, a served request's, an
arm's, a replay run's, a tier's traffic) is a dataclass deriving from :class:`Tally`: its fields
marked :func:`adds` are summed by ``+`` (numbers add, dicts add key by key, sequences
concatenate) and every field is written by :meth:`Tally.as_dict` (through the field's
``json`` converter when it has one), so no record lists its fields by hand. :class:`Counters`
holds the counts the window's records share: forwards, tokens prefilled, chunks encoded,
patches formed and reused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, TypeVar

T = TypeVar("T", bound="Tally")

OMIT = "omit"  # a field's ``json`` metadata: leave it out of ``as_dict``


def adds(default: Any = 0, *, json: "Callable[[Any], Any] | str | None" = None, name: str | None = None,
         merge: "Callable[[Any, Any], Any] | None" = None, **kw: Any) -> Any:
    """A dataclass field that ``+`` sums (``default`` may be a value or, for a dict / list, its
    type). ``json``: how :meth:`Tally.as_dict` writes it (``OMIT``: not at all); ``name``: under
    which key; ``merge``: how two values combine instead of the generic sum."""
    meta = {"adds": True, "json": json, "json_name": name, "merge": merge}
    if default in (dict, list, tuple):
        return field(default_factory=default, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def shown(json: "Callable[[Any], Any] | str | None" = None, *, name: str | None = None, default: Any = None,
          factory: Any = None, **kw: Any) -> Any:
    """A field that is not summed (``+`` keeps the left record's), written through ``json``."""
    meta = {"json": json, "json_name": name}
    if factory is not None:
        return field(default_factory=factory, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def _sum(a: Any, b: Any) -> Any:
    if isinstance(a, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = _sum(out[k], v) if k in out else v
        return out
    if isinstance(a, list):
        return a + list(b)
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def jsonable(value: Any) -> Any:
    """A JSON-friendly copy: records through their ``as_dict``, sequences as lists, dicts copied."""
    if hasattr(value, "as_dict"):
        return value.as_dict()
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


@dataclass
class Tally:
    """Base of every cost record: generic ``+`` over its :func:`adds` fields, generic ``as_dict``.

    ``json_omit``: inherited fields a record does not count (left out of its ``as_dict``);
    ``json_names``: inherited fields it writes under its own key."""

    json_omit: ClassVar[frozenset[str]] = frozenset()
    json_names: ClassVar[dict[str, str]] = {}  # inherited fields a record writes under another key

    def __add__(self: T, other: T) -> T:
        """This record with ``other``'s added fields summed in (the other fields stay this one's)."""
        out = dataclasses.replace(self)
        out += other  # (sums make new values: this record's dicts and sequences are not changed)
        return out

    def __iadd__(self: T, other: Any) -> T:
        """Sum ``other``'s added fields into this record (``other`` may be any record holding them)."""
        for f in dataclasses.fields(self):
            if f.metadata.get("adds"):
                a, b = getattr(self, f.name), getattr(other, f.name)
                merge = f.metadata.get("merge")
                setattr(self, f.name, merge(a, b) if merge is not None else _sum(a, b))
        return self

    @classmethod
    def summed(cls: type[T], records: Iterable[Any], **fields: Any) -> T:
        """A new record (built with ``fields``) with every one of ``records`` added in."""
        out = cls(**fields)
        for r in records:
            out += r
        return out

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy: every field, through its ``json`` converter, under its name."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            conv = f.metadata.get("json")
            if conv == OMIT or f.name in self.json_omit:
                continue
            value = getattr(self, f.name)
            key = self.json_names.get(f.name) or f.metadata.get("json_name") or f.name
            out[key] = conv(value) if conv is not None else jsonable(value)
        out.update(self._derived())
        return out

    def _derived(self) -> dict[str, Any]:
        """Figures ``as_dict`` adds beside the fields (properties of the record)."""
        return {}


@dataclass(kw_only=True)
class Counters(Tally):
    """The counts the window's records share (a window operation, a sync, a served request, a
    saved session's summary): ``forwards`` (model forwards run), ``tokens_prefilled`` (tokens
    they processed), ``encodes`` (chunks encoded), ``patches_formed`` (conditioning patches a
    forward formed), ``patches_reused`` (patches served by the store instead)."""

    forwards: int = adds()
    tokens_prefilled: int = adds()
    encodes: int = adds()
    patches_formed: int = adds()
    patches_reused: int = adds()

    def counts(self) -> dict[str, int]:
        """Just these counts (whatever record holds them)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Counters)}
