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

import logging
import os
import threading
import types
import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

import torch

from contextdeque.core.args import check_int, check_str
from contextdeque.core.errors import (
    CollisionError,
    FingerprintMismatchError,
    InvalidEntryError,
    StoreCapacityError,
    StoreConfigError,
)
from contextdeque.core.kv import tensor_nbytes
from contextdeque.core.registry import Registered
from contextdeque.stores.registry import TIERS

if TYPE_CHECKING:  # pragma: no cover
    from contextdeque.stores.policy import EvictionPolicy

log = logging.getLogger("contextdeque.stores")

RESERVED_META_PREFIX = "cdq."
"""Metadata keys with this prefix belong to the store's on-disk format."""

META_FINGERPRINT = "fingerprint"
META_LAYOUT = "layout"
META_KIND = "kind"
META_DIGEST = "content_digest"


# --------------------------------------------------------------------------------------
# Entries
# --------------------------------------------------------------------------------------


def _meta_field(key: str, doc: str) -> property:
    """A read-only view of one metadata item of an entry (None when absent)."""
    return property(lambda self: self.meta.get(key), doc=doc)


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

    fingerprint = _meta_field(META_FINGERPRINT, "The model fingerprint recorded in the metadata, if any.")
    layout = _meta_field(META_LAYOUT, "The layout signature recorded in the metadata, if any.")
    kind = _meta_field(META_KIND, '``"chunk" | "patch" | "embeds"`` (or whatever the writer recorded).')
    content_digest = _meta_field(META_DIGEST, 'The collision guard\'s witness (``meta["content_digest"]``), if any.')

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


@dataclass(frozen=True)
class Expect:
    """What a read must find, checked on the entry's metadata before its tensors are used (see
    `check_expectations`): the model fingerprint, the layout signature, the content digest."""

    fingerprint: str | None = None
    layout: str | None = None
    digest: str | None = None

    def check(self, key: str, meta: Mapping[str, str]) -> None:
        """Raise `FingerprintMismatchError` / `CollisionError` when ``meta`` is not what is expected."""
        check_expectations(key, meta, expect_fingerprint=self.fingerprint, expect_layout=self.layout,
                           expect_digest=self.digest)


@dataclass(frozen=True)
class PutRequest:
    """How one `Tier.put` writes (its keyword arguments, checked once by `Tier.put`)."""

    pinned: bool = False
    priority: int = 0
    overwrite: bool = False
    keep_evicted: bool = False
    copy: bool = True


def check_key(key: object) -> str:
    """``key`` as a store key (a str), else `TypeError`."""
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__}")
    return key


class Tier(ABC, Registered):
    """One storage level with a byte budget and an eviction policy.

    The contract is written here once: `get` / `put` argument handling, the choice of eviction
    victims (`choose_victims`), and this process's leases with their renewal (`lease`,
    `unlease`, `leased`). A tier implements only what differs: how it reads (`_read`) and writes
    (`_write`) one entry, deletes, lists, counts and pins, and, for a tier shared between processes
    (``shared = True``), how it takes, drops and renews a lease (`_take_leases`, `_drop_leases`,
    `renew_leases`).

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
    #: True when other processes share the entries, so a process announces what it holds (`lease`)
    shared: bool = False

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
        self._held: set[str] = set()  # keys this process leases (see `lease`)
        self._held_pid = os.getpid()
        self._renewer: threading.Thread | None = None
        self._closed = threading.Event()

    @property
    def budget_bytes(self) -> int | None:
        """The byte budget (None: unbounded)."""
        return self._budget

    # ------------------------------------------------------------------ the contract

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
        return self._read(check_key(key), Expect(expect_fingerprint, expect_layout, expect_digest), bool(corrupt_ok))

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
        ``keep_evicted``: hand back the victims' contents (`Evicted.entry`) where the tier still
        has them, so they can spill into a lower tier.

        Raises:
            CollisionError: ``key`` holds a different ``content_digest`` (and not ``overwrite``).
            StoreCapacityError: the entry cannot fit in the budget (too big, or the rest is
                pinned); nothing is evicted then.
            StoreUnavailableError: a remote tier is away; nothing was written.
        """
        check_key(key)
        if not isinstance(entry, StoreEntry):
            raise InvalidEntryError(f"a tier stores StoreEntry objects, got {type(entry).__name__}")
        entry.user_meta_check()
        return self._write(key, entry, PutRequest(bool(pinned), int(priority), bool(overwrite), bool(keep_evicted), bool(copy)))

    # ------------------------------------------------------------------ what a tier implements

    @abstractmethod
    def _read(self, key: str, expect: Expect, corrupt_ok: bool) -> StoreEntry | None:
        """`get` for a checked key: the entry (marked used) or None; ``expect`` is checked on
        the metadata before the tensors are used; a corrupt copy raises, or with ``corrupt_ok``
        is dropped and read as None."""

    @abstractmethod
    def _write(self, key: str, entry: StoreEntry, request: PutRequest) -> PutResult:
        """`put` for a checked key and entry (see `put` for what ``request`` asks)."""

    @abstractmethod
    def peek(self, key: str) -> Mapping[str, str] | None:
        """The entry's metadata without loading tensors or marking it used; None if absent.

        Raises:
            CorruptEntryError: the stored metadata cannot be read.
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

    # ------------------------------------------------------------------ eviction

    def choose_victims(self, key: str, over: int, candidates: Sequence[EntryStat], usage: str) -> list[str]:
        """Keys of ``candidates`` (the evictable entries) in the policy's order, until ``over``
        more bytes are freed; nothing when ``over <= 0``.

        Raises:
            StoreCapacityError: evicting every candidate frees too little (the rest is pinned);
                ``usage`` says how full the tier is, for the message.
        """
        if over <= 0:
            return []
        sizes = {c.key: c.nbytes for c in candidates}
        victims: list[str] = []
        for k in self.policy.order(candidates):
            if over <= 0:
                break
            victims.append(k)
            over -= sizes[k]
        if over > 0:
            raise StoreCapacityError(f"tier {self.name!r} cannot make room for {key!r}: {usage} and the rest is pinned")
        return victims

    # ------------------------------------------------------------------ leases

    def _holds(self) -> set[str]:
        """The keys this process leases; a forked child starts with none (and no renewer)."""
        if self._held_pid != os.getpid():
            self._held_pid = os.getpid()
            self._held = set()
            self._renewer = None
        return self._held

    def lease(self, keys: "list[str] | tuple[str, ...]") -> None:
        """Announce that this process holds ``keys`` (stored or not yet) until `unlease`. A shared
        tier keeps them for other processes to see and its expiry to respect, renewing them while
        held (`renew_leases`); a local tier has nobody to tell: a no-op."""
        if not self.shared:
            return
        with self._lock:
            held = self._holds()
            keys = [k for k in dict.fromkeys(keys) if k not in held]
            held.update(keys)
        if keys:
            self._take_leases(keys)
            self._keep_renewing()

    def unlease(self, keys: "list[str] | tuple[str, ...]") -> None:
        """Undo `lease` for ``keys`` (a no-op for a local tier)."""
        if not self.shared:
            return
        with self._lock:
            held = self._holds()
            keys = [k for k in dict.fromkeys(keys) if k in held]
            held.difference_update(keys)
        if keys:
            self._drop_leases(keys)

    def leased(self) -> set[str]:
        """Keys this tier instance leases."""
        with self._lock:
            return set(self._holds())

    def _take_leases(self, keys: list[str]) -> None:
        """Make the leases on ``keys`` visible to the other processes (a shared tier's primitive)."""

    def _drop_leases(self, keys: list[str]) -> None:
        """Withdraw this process's leases on ``keys`` (a shared tier's primitive)."""

    @property
    def renew_every_s(self) -> float | None:
        """Seconds between renewals of this process's leases and pins (None: they never lapse)."""
        return None

    def renew_leases(self) -> int:
        """Renew this process's leases (and pins, where they lapse too); returns how many."""
        return 0

    def _keep_renewing(self) -> None:
        """Start the renewer thread (once per process) if leases here lapse without renewal."""
        period = self.renew_every_s
        with self._lock:
            self._holds()  # a forked child forgets its parent's renewer
            if period is None or self._renewer is not None:
                return
            self._renewer = _start_renewer(self, period)

    def close(self) -> None:
        """Stop renewing leases (they lapse) and release what the tier holds open."""
        self._closed.set()

    # ------------------------------------------------------------------ conveniences

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

    def _fits_budget(self, nbytes: int) -> bool:
        return self._budget is None or nbytes <= self._budget


def _start_renewer(tier: Tier, period: float) -> threading.Thread:
    """A daemon thread calling ``tier.renew_leases()`` every ``period`` seconds while the tier
    lives, is not closed, and this is the process that started it."""
    ref = weakref.ref(tier)
    closed = tier._closed
    pid = os.getpid()

    def run() -> None:
        while not closed.wait(period):
            t = ref()
            if t is None or os.getpid() != pid:
                return
            try:
                t.renew_leases()
            except Exception:  # noqa: BLE001 - a renewal is retried next period; never let the thread die
                log.warning("store tier %r: renewing leases failed; retrying", t.name, exc_info=True)
            del t

    th = threading.Thread(target=run, name=f"{tier.kind}-lease-renewer-{tier.name}", daemon=True)
    th.start()
    return th
