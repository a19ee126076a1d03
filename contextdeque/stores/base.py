"""Core types of the stores: entries, keys, and the abstract `Tier`.

An *entry* is what a tier holds under one string key: a flat `dict[str, torch.Tensor]`
plus a flat `dict[str, str]` of metadata. The window layer serializes a Chunk / Patch into
an entry; the stores never look inside the tensors (content-addressed, model-agnostic).

Metadata keys the stores understand (all optional, all strings):
- ``fingerprint``: model fingerprint, checked by ``get(..., expect_fingerprint=...)``;
- ``layout``: layout signature, checked by ``get(..., expect_layout=...)``;
- ``kind``: ``"chunk" | "patch" | "embeds"`` (free-form for the stores);
- ``content_digest``: digest of the entry's content, the collision guard's witness.

Keys starting with ``cdq.`` are reserved for the on-disk format.
"""

from __future__ import annotations

import threading
import types
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

import torch

from contextdeque.core.args import check_int, check_str
from contextdeque.core.errors import CollisionError, FingerprintMismatchError, InvalidEntryError, StoreConfigError
from contextdeque.core.kv import tensor_nbytes
from contextdeque.core.registry import Registered
from contextdeque.stores.registry import TIERS

if TYPE_CHECKING:  # pragma: no cover
    from contextdeque.stores.policy import EvictionPolicy

RESERVED_META_PREFIX = "cdq."
"""Metadata keys with this prefix belong to the store's on-disk format."""

META_FINGERPRINT = "fingerprint"
META_LAYOUT = "layout"
META_KIND = "kind"
META_DIGEST = "content_digest"


# --------------------------------------------------------------------------------------
# Entries
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class StoreEntry:
    """One stored bundle: named tensors plus flat string metadata.

    Attributes:
        tensors: name -> tensor, any shapes/dtypes (e.g. ``"l3.k": [H_k, T, d_k]``).
            Read-only view; tensors returned by a tier are the tier's own copies and must
            not be modified in place.
        meta: flat ``str -> str`` metadata (read-only view), see the module docstring.
        nbytes: payload bytes, the sum of ``numel * element_size`` over the tensors. This
            is what the in-memory tiers budget and what `TierTraffic` counts.
    """

    tensors: Mapping[str, torch.Tensor]
    meta: Mapping[str, str] = field(default_factory=dict)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tensors, Mapping):
            raise InvalidEntryError(f"entry tensors must be a mapping, got {type(self.tensors).__name__}")
        if not isinstance(self.meta, Mapping):
            raise InvalidEntryError(f"entry meta must be a mapping, got {type(self.meta).__name__}")
        tensors: dict[str, torch.Tensor] = {}
        for name, t in self.tensors.items():
            if not isinstance(name, str) or not name or name == "__metadata__":
                raise InvalidEntryError(f"invalid tensor name {name!r}")
            if not isinstance(t, torch.Tensor):
                raise InvalidEntryError(f"entry value {name!r} is a {type(t).__name__}, not a torch.Tensor")
            if t.layout is not torch.strided:
                raise InvalidEntryError(f"tensor {name!r} has layout {t.layout}; only dense tensors are stored")
            tensors[name] = t.detach()
        meta: dict[str, str] = {}
        for k, v in self.meta.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise InvalidEntryError(f"entry metadata must be str -> str, got {k!r}: {type(v).__name__}")
            meta[k] = v
        object.__setattr__(self, "tensors", types.MappingProxyType(tensors))
        object.__setattr__(self, "meta", types.MappingProxyType(meta))
        object.__setattr__(self, "nbytes", sum(tensor_nbytes(t) for t in tensors.values()))

    def __repr__(self) -> str:
        items = list(self.tensors.items())
        shapes = ", ".join(f"{n}: {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for n, t in items[:6])
        if len(items) > 6:
            shapes += f", ... ({len(items)} tensors)"
        return f"StoreEntry({{{shapes}}}, nbytes={self.nbytes}, meta={dict(self.meta)})"

    def user_meta_check(self) -> None:
        """Raise `InvalidEntryError` if the metadata uses the reserved ``cdq.`` prefix."""
        bad = [k for k in self.meta if k.startswith(RESERVED_META_PREFIX)]
        if bad:
            raise InvalidEntryError(f"metadata keys {bad} use the reserved prefix {RESERVED_META_PREFIX!r}")

    @property
    def fingerprint(self) -> str | None:
        """The model fingerprint recorded in the metadata, if any."""
        return self.meta.get(META_FINGERPRINT)

    @property
    def layout(self) -> str | None:
        """The layout signature recorded in the metadata, if any."""
        return self.meta.get(META_LAYOUT)

    @property
    def kind(self) -> str | None:
        """``"chunk" | "patch" | "embeds"`` (or whatever the writer recorded)."""
        return self.meta.get(META_KIND)

    @property
    def content_digest(self) -> str | None:
        """The collision guard's witness (``meta["content_digest"]``), if any."""
        return self.meta.get(META_DIGEST)

    def with_tensors(self, tensors: Mapping[str, torch.Tensor]) -> StoreEntry:
        """A new entry with the same metadata and the given tensors (e.g. moved to a device)."""
        return StoreEntry(tensors=tensors, meta=dict(self.meta))


def check_expectations(
    key: str,
    meta: Mapping[str, str],
    *,
    expect_fingerprint: str | None = None,
    expect_layout: str | None = None,
    expect_digest: str | None = None,
) -> None:
    """Refuse an entry stored for another model / layout, or with another content.

    Raises:
        FingerprintMismatchError: ``fingerprint`` or ``layout`` differ from (or are
            missing while) the expected ones.
        CollisionError: ``content_digest`` differs from ``expect_digest``.
    """
    if expect_fingerprint is not None and meta.get(META_FINGERPRINT) != expect_fingerprint:
        raise FingerprintMismatchError(
            f"store entry {key!r} was written for model fingerprint {meta.get(META_FINGERPRINT)!r}, "
            f"expected {expect_fingerprint!r}; refusing to load it"
        )
    if expect_layout is not None and meta.get(META_LAYOUT) != expect_layout:
        raise FingerprintMismatchError(
            f"store entry {key!r} was written for layout {meta.get(META_LAYOUT)!r}, "
            f"expected {expect_layout!r}; refusing to load it"
        )
    if expect_digest is not None and meta.get(META_DIGEST) != expect_digest:
        raise CollisionError(
            f"store entry {key!r} holds content_digest {meta.get(META_DIGEST)!r}, "
            f"expected {expect_digest!r} (key collision or stale entry)"
        )


def check_collision(key: str, existing: Mapping[str, str], new: Mapping[str, str]) -> bool:
    """Collision guard for ``put``: is the stored entry the same content as the new one?

    Returns True when both record the same ``content_digest`` (the put is a no-op), False
    when neither records one (nothing to compare: the put replaces the entry).

    Raises:
        CollisionError: the digests differ, or only one side records a digest.
    """
    old_d, new_d = existing.get(META_DIGEST), new.get(META_DIGEST)
    if old_d is None and new_d is None:
        return False
    if old_d != new_d:
        raise CollisionError(
            f"key {key!r} already holds content_digest {old_d!r}; refusing to overwrite it with "
            f"{new_d!r} (pass overwrite=True to replace on purpose)"
        )
    return True


# --------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------


def _q(part: str) -> str:
    if not isinstance(part, str):
        raise TypeError(f"key components must be str, got {type(part).__name__}")
    # Percent-encode everything but unreserved characters: injective, and '/' separates.
    return quote(part, safe="")


@dataclass(frozen=True)
class StoreKey:
    """A parsed store key: a namespace (``"chunk" | "patch" | "embeds"``) and its parts.

    ``str(StoreKey)`` is the stable string used as a store key; `StoreKey.parse` inverts it.
    The encoding is injective (each part percent-encoded, joined by ``/``). A patch key's parts
    are the patch layer's (`contextdeque.patch.keys.patch_key_parts`); the stores never read them.
    """

    namespace: str
    parts: tuple[str, ...]

    def __str__(self) -> str:
        return "/".join([_q(self.namespace), *(_q(p) for p in self.parts)])

    @classmethod
    def parse(cls, key: str) -> StoreKey:
        """Invert ``str(StoreKey(...))``."""
        ns, *parts = key.split("/")
        return cls(unquote(ns), tuple(unquote(p) for p in parts))


def chunk_key(fingerprint: str, content_hash: str) -> str:
    """Key of a canonical chunk: (model fingerprint, content hash of the chunk's inputs)."""
    return str(StoreKey("chunk", (fingerprint, content_hash)))


def embeds_key(fingerprint: str, content_hash: str) -> str:
    """Key of a chunk's encoder embeddings (multimodal chunks), beside its canonical."""
    return str(StoreKey("embeds", (fingerprint, content_hash)))


# --------------------------------------------------------------------------------------
# Tier interface
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EntryStat:
    """What an eviction policy sees of one evictable entry.

    Attributes:
        key: store key (for an unreadable disk file: its file name).
        nbytes: bytes the entry occupies in the tier's budget.
        last_used: recency stamp, larger = more recent (tier-local unit).
        priority: larger = keep longer (used by priority-aware policies).
    """

    key: str
    nbytes: int
    last_used: int
    priority: int = 0


@dataclass(frozen=True)
class Evicted:
    """An entry a tier evicted to make room.

    ``entry`` is the evicted content when the tier still had it in hand (in-memory tiers
    always; the disk tier only when asked to keep evicted entries), so an upper tier's
    victims can spill down instead of being lost. ``nbytes`` is the payload size.
    """

    key: str
    nbytes: int
    priority: int
    entry: StoreEntry | None


@dataclass(frozen=True)
class PutResult:
    """Outcome of `Tier.put`: whether bytes were written, and what was evicted for them."""

    stored: bool
    evicted: tuple[Evicted, ...] = ()


class Tier(ABC, Registered):
    """One storage level with a byte budget and an eviction policy.

    Pinned entries are never evicted while pinned; `delete` still removes them.
    Implementations are safe to share between threads of one process.

    A *remote* tier (``remote = True``, e.g. `ValkeyTier`) may be away: its reads then answer
    as misses, its writes raise `StoreUnavailableError`, and it reports each such fallback
    with `contextdeque.stores.traffic.report_fallback`.
    """

    registry = TIERS
    registry_key = "kind"
    #: registry name: a subclass that sets it is registered under it (contextdeque.core.registry)
    kind: str = "abstract"
    #: True when entries survive the process (write-through targets)
    persistent: bool = False
    #: True when the tier lives on another machine and can be away (see the class docstring)
    remote: bool = False

    def __init__(self, *, name: str, budget_bytes: int | None, policy: str | EvictionPolicy = "lru") -> None:
        from contextdeque.stores.registry import make_policy

        check_int("budget_bytes", budget_bytes, minimum=0, none_ok=True, error=StoreConfigError)
        check_str("name", name, error=StoreConfigError)
        if not name:
            raise StoreConfigError("name must be a non-empty tier name")
        self.name = name
        self._budget = budget_bytes
        self.policy = make_policy(policy)
        self._lock = threading.RLock()

    @property
    def budget_bytes(self) -> int | None:
        """The byte budget (None: unbounded)."""
        return self._budget

    @abstractmethod
    def get(
        self,
        key: str,
        *,
        expect_fingerprint: str | None = None,
        expect_layout: str | None = None,
        expect_digest: str | None = None,
        corrupt_ok: bool = False,
    ) -> StoreEntry | None:
        """The entry under ``key`` (marking it used), or None when absent.

        Raises:
            CorruptEntryError: stored bytes fail verification (unless ``corrupt_ok``, then
                the bad copy is dropped and None returned).
            FingerprintMismatchError: ``expect_fingerprint`` / ``expect_layout`` differ.
            CollisionError: ``expect_digest`` differs from the entry's ``content_digest``.
        """

    @abstractmethod
    def peek(self, key: str) -> Mapping[str, str] | None:
        """The entry's metadata without loading tensors or marking it used; None if absent.

        Raises:
            CorruptEntryError: the stored metadata cannot be read.
        """

    @abstractmethod
    def put(
        self,
        key: str,
        entry: StoreEntry,
        *,
        pinned: bool = False,
        priority: int = 0,
        overwrite: bool = False,
        keep_evicted: bool = False,
        copy: bool = True,
    ) -> PutResult:
        """Store ``entry`` under ``key``, evicting unpinned entries by policy if needed.

        If ``key`` exists with the same ``content_digest`` nothing is written (it is marked
        used, and pinned if asked). ``copy=False`` lets an in-memory tier keep the given
        tensors when they already live on its device (the caller hands them over).

        Raises:
            CollisionError: ``key`` holds a different ``content_digest`` (and not ``overwrite``).
            StoreCapacityError: the entry cannot fit in the budget (too big, or the rest is
                pinned); nothing is evicted then.
            StoreUnavailableError: a remote tier is away; nothing was written.
        """

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key`` (pinned or not); True if it was present."""

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored (without verifying it)."""

    @abstractmethod
    def keys(self) -> list[str]:
        """All stored keys (disk: those whose header is readable)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes counted against the budget right now."""

    @abstractmethod
    def priority_of(self, key: str) -> int:
        """The eviction priority ``key`` was stored with (0 if absent or unknown)."""

    @abstractmethod
    def pin(self, key: str) -> bool:
        """Protect ``key`` from eviction; False if absent."""

    @abstractmethod
    def unpin(self, key: str) -> bool:
        """Make ``key`` evictable again; False if it was not pinned."""

    @abstractmethod
    def is_pinned(self, key: str) -> bool:
        """Whether ``key`` is pinned."""

    def lease(self, keys: "list[str] | tuple[str, ...]") -> None:
        """Announce that this process holds ``keys`` (stored or not yet) until `unlease`. A shared
        tier keeps them for other processes to see and its expiry to respect (`ValkeyTier`: a
        lease with expiry, renewed while held); a local tier has nobody to tell: a no-op."""

    def unlease(self, keys: "list[str] | tuple[str, ...]") -> None:
        """Undo `lease` for ``keys`` (a no-op for a local tier)."""

    def verify(self, key: str) -> bool:
        """True iff ``key`` is present and passes verification (a corrupt copy counts as absent)."""
        from contextdeque.core.errors import CorruptEntryError

        try:
            return self.get(key, corrupt_ok=False) is not None
        except CorruptEntryError:
            return False

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.contains(key)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, budget_bytes={self._budget}, "
            f"policy={self.policy.name!r})"
        )

    # helpers shared by implementations -----------------------------------------------

    def _fits_budget(self, nbytes: int) -> bool:
        return self._budget is None or nbytes <= self._budget
