"""The window's view of a ``TieredStore``: chunks and patches as store entries, residency.

Canonicals and patches live in the store, content-addressed (``chunk_key`` / ``patch_key``).
While any window (or fork) holds a chunk in its slots, its canonical and patches stay in the
fastest tier, and are *leased* in the tiers other processes share (a ``DiskTier`` directory, a
Valkey server): no process's budget evicts a leased entry there, and a dead holder's leases
lapse (see ``DiskTier`` and ``ValkeyTier``). When the last holder lets go (evict, slide), the
leases go and the entries are *demoted* one tier down (device -> host -> disk), never dropped by
the window.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:  # pragma: no cover
    import os
    from pathlib import Path

import torch

from ..core.chunk import Chunk
from ..core.errors import ArgumentTypeError, CollisionError, StoreConfigError, StoreError
from ..patch import Patch, patch_key_parts
if TYPE_CHECKING:  # pragma: no cover
    from ..model.vision import ImageEmbedding

from ..stores import DiskTier, HostTier, MemoryTier, StoreEntry, StoreKey, Tier, TieredStore, TierTraffic, chunk_key, embeds_key
from ..stores.traffic import recording

_ADAPTERS: "weakref.WeakKeyDictionary[TieredStore, WindowStore]" = weakref.WeakKeyDictionary()


MEMORY_BUDGET_ENV = "CONTEXTDEQUE_MEMORY_BUDGET"
"""The default store's memory budget: bytes (``"536870912"``, ``"512MiB"``, ``"2GB"``) or a share of
the machine's RAM (``"10%"``)."""
DISK_BUDGET_ENV = "CONTEXTDEQUE_DISK_BUDGET"
"""The default store's disk budget (same forms; a percentage is of the free space)."""
STORE_DIR_ENV = "CONTEXTDEQUE_STORE_DIR"
"""Where the default store's disk tier lives (default: ``<cache dir>/store``, per user)."""
DEFAULT_MEMORY_FRACTION = 0.10  # of RAM
DEFAULT_DEVICE_FRACTION = 0.25  # of an accelerator's memory
DEFAULT_DISK_BYTES = 8 << 30  # at most, and at most a quarter of the free space

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(spec: int | float | str, of: int | None = None, what: str = "budget") -> int:
    """Bytes from ``spec``: an int, ``"512MiB"`` / ``"2GB"`` / ``"123"``, or ``"10%"`` of ``of``.

    Raises:
        StoreConfigError: anything else (the message names ``what``)."""
    import re

    if isinstance(spec, bool):
        raise StoreConfigError(f"{what} must be bytes or a size like '512MiB' or '10%', got {spec!r}")
    if isinstance(spec, (int, float)):
        n = float(spec)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%|[a-zA-Z]*)\s*", str(spec))
        if m is None or (m.group(2) != "%" and m.group(2).lower() not in _UNITS):
            raise StoreConfigError(f"{what} must be bytes or a size like '512MiB' or '10%', got {spec!r}")
        if m.group(2) == "%":
            if of is None:
                raise StoreConfigError(f"{what}: a percentage needs a total to take it of, got {spec!r}")
            n = float(m.group(1)) / 100.0 * of
        else:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not n >= 0:
        raise StoreConfigError(f"{what} must be >= 0, got {spec!r}")
    return int(n)


def machine_memory() -> int:
    """Physical RAM in bytes (0 where the platform does not say)."""
    import os

    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def default_memory_budget() -> int:
    """The default store's memory budget: ``$CONTEXTDEQUE_MEMORY_BUDGET``, else 10% of RAM."""
    import os

    ram = machine_memory()
    spec = os.environ.get(MEMORY_BUDGET_ENV)
    if spec:
        return parse_bytes(spec, ram, MEMORY_BUDGET_ENV)
    return int(DEFAULT_MEMORY_FRACTION * ram) if ram else 1 << 30


def default_store_dir() -> "Path":
    """``$CONTEXTDEQUE_STORE_DIR``, else ``<contextdeque cache dir>/store`` (per user)."""
    import os
    from pathlib import Path

    from ..model.default_model import default_cache_dir

    env = os.environ.get(STORE_DIR_ENV)
    return Path(env).expanduser() if env else default_cache_dir() / "store"


def default_store(
    device: torch.device | str,
    *,
    memory_budget: int | str | None = None,
    disk_budget: int | str | None = None,
    disk_dir: "str | os.PathLike[str] | None" = None,
    disk: bool = True,
) -> TieredStore:
    """The store a window gets when given none: bounded memory that spills to disk.

    Tiers: ``device`` (where the model runs), ``host`` (CPU RAM), ``disk`` (a ``DiskTier`` in the
    per-user cache directory, shared by the user's processes through leases). The memory budget
    (``memory_budget``, else ``$CONTEXTDEQUE_MEMORY_BUDGET``, else 10% of RAM) bounds the RAM the
    store keeps: on a CPU model the device and host tiers share it half and half; on an
    accelerator the device tier gets 25% of its memory and the host tier the whole budget.
    Entries the memory tiers evict spill to disk; entries the disk budget (``disk_budget``, else
    ``$CONTEXTDEQUE_DISK_BUDGET``, else min(8 GiB, 25% of the free space)) evicts are dropped, and
    a window recalling such a chunk re-encodes it from its source (one forward, in the receipt).
    Entries windows hold are pinned (leased): no budget evicts them. ``disk=False``: memory
    tiers only (what overflows the budget is dropped).
    """
    import os
    import shutil

    dev = torch.device(device)
    mem = default_memory_budget() if memory_budget is None else parse_bytes(memory_budget, machine_memory(), "memory_budget")
    if dev.type == "cpu":
        tiers: list[Tier] = [MemoryTier(dev, mem // 2, name="device"), HostTier(mem - mem // 2, name="host")]
    else:
        total = 0
        if dev.type == "cuda" and torch.cuda.is_available():
            total = int(torch.cuda.get_device_properties(dev).total_memory)
        dev_budget = int(DEFAULT_DEVICE_FRACTION * total) if total else mem
        tiers = [MemoryTier(dev, dev_budget, name="device"), HostTier(mem, name="host")]
    if disk:
        path = default_store_dir() if disk_dir is None else disk_dir
        spec = disk_budget if disk_budget is not None else os.environ.get(DISK_BUDGET_ENV)
        os.makedirs(path, exist_ok=True)
        free = shutil.disk_usage(path).free
        budget = min(DEFAULT_DISK_BYTES, free // 4) if spec is None else parse_bytes(spec, free, "disk_budget")
        tiers.append(DiskTier(path, budget, fsync=False, name="disk"))
    return TieredStore(tiers)


class WindowStore:
    """Chunk/patch access and residency bookkeeping over one ``TieredStore``.

    One adapter per store object (:meth:`wrap` memoizes), so every window and fork sharing a
    store shares the hold counts that decide demotion.
    """

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self._holds: Counter[str] = Counter()
        #: keys released by every holder, to demote (those a store fault refused are retried on the
        #: next release), in the order they were let go: the slots' order (the replay's as well)
        self._undemoted: dict[str, None] = {}
        # keys an operation in progress looked up or wrote: leased at once, so no other process
        # evicts them between the lookup and the operation's end (when held keys are leased)
        self._in_flight: set[str] = set()
        #: (kind, tier that served it or "miss") -> lookups, kind in chunk / patch / embeds
        self.lookups: Counter[tuple[str, str]] = Counter()

    def _count(self, kind: str, traffic: TierTraffic) -> None:
        self.lookups[(kind, traffic.served_from or "miss")] += 1

    @classmethod
    def wrap(cls, store: Any, device: torch.device | str = "cpu") -> "WindowStore":
        """``None`` (default two-tier store), a ``Tier``, a sequence of tiers (fastest first), a
        ``TieredStore`` or a ``WindowStore``."""
        if isinstance(store, WindowStore):
            return store
        if store is None:
            store = default_store(device)
        elif isinstance(store, Tier):
            store = TieredStore([store])
        elif isinstance(store, (list, tuple)):
            store = TieredStore(list(store))
        if not isinstance(store, TieredStore):
            raise ArgumentTypeError(f"store must be a TieredStore, a Tier or a list of tiers, got {type(store).__name__}")
        found = _ADAPTERS.get(store)
        if found is None:
            found = cls(store)
            _ADAPTERS[store] = found
        return found

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self.store.tiers]

    # ------------------------------------------------------------------ chunks
    @staticmethod
    def chunk_key(chunk_or_id: Chunk | str, fingerprint: str | None = None) -> str:
        if isinstance(chunk_or_id, Chunk):
            return chunk_key(chunk_or_id.fingerprint, chunk_or_id.id)
        assert fingerprint is not None
        return chunk_key(fingerprint, chunk_or_id)

    @staticmethod
    def patch_key(chunk: Chunk, signature: str, kind: str, ranks: int | tuple[int, int]) -> str:
        """Store key of a patch of ``chunk``: the patch layer's key parts (scheme version,
        signature, stored kind, ranks; ``patch.keys.patch_key_parts``) under ``"patch"``."""
        return str(StoreKey("patch", patch_key_parts(WindowStore.chunk_key(chunk), signature, kind, ranks)))

    def has(self, key: str) -> bool:
        return self.store.contains(key)

    def get_chunk(self, key: str, *, fingerprint: str, layout: str, traffic: TierTraffic) -> Chunk | None:
        """The canonical under ``key`` (promoted to the fastest tier), or None.

        A copy failing verification is quarantined (``traffic.quarantined``) and the next tier's
        copy served, or None: the window then rebuilds it from its source.
        Raises FingerprintMismatchError for an entry another model or layout wrote."""
        self._lease_in_flight(key, traffic)
        entry = self.store.get(key, expect_fingerprint=fingerprint, expect_layout=layout, corrupt_ok=True, traffic=traffic)
        self._count("chunk", traffic)
        if entry is None:
            return None
        return Chunk.from_entry(dict(entry.tensors), dict(entry.meta))

    def put_chunk(self, chunk: Chunk, *, traffic: TierTraffic) -> str:
        """Store ``chunk`` (a no-op when already there); returns its key."""
        key = self.chunk_key(chunk)
        tensors, meta = chunk.to_entry()
        self._lease_in_flight(key, traffic)
        self.store.put(key, StoreEntry(tensors, meta), traffic=traffic)
        return key

    # ------------------------------------------------------------------ encoder embeddings
    def get_embeds(self, fingerprint: str, pixel_key: str, *, traffic: TierTraffic) -> "ImageEmbedding | None":
        """A vision tower's stored output for these pixels + processor settings, or None."""
        from ..model.vision import ImageEmbedding

        entry = self.store.get(embeds_key(fingerprint, pixel_key), expect_fingerprint=fingerprint, corrupt_ok=True, traffic=traffic)
        self._count("embeds", traffic)
        return None if entry is None else ImageEmbedding.from_entry(dict(entry.tensors), dict(entry.meta))

    def put_embeds(self, fingerprint: str, emb: "ImageEmbedding", *, traffic: TierTraffic) -> None:
        tensors, meta = emb.to_entry(fingerprint)
        self.store.put(embeds_key(fingerprint, emb.pixel_key), StoreEntry(tensors, meta), traffic=traffic)

    # ------------------------------------------------------------------ patches
    def get_patch(self, key: str, *, fingerprint: str, traffic: TierTraffic) -> Patch | None:
        self._lease_in_flight(key, traffic)
        entry = self.store.get(key, expect_fingerprint=fingerprint, corrupt_ok=True, traffic=traffic)
        self._count("patch", traffic)
        if entry is None:
            return None
        return Patch.from_entry(dict(entry.tensors), dict(entry.meta))

    def put_patch(self, key: str, patch: Patch, *, traffic: TierTraffic) -> str | None:
        """Store ``patch`` under ``key``. A patch is a cache of one forward: when the store cannot
        take it (a collision, a read-only or full tier) the window goes on with the patch it has
        in hand; returns why it was not (fully) stored, else None."""
        tensors, meta = patch.to_entry()
        self._lease_in_flight(key, traffic)
        try:
            self.store.put(key, StoreEntry(tensors, meta), traffic=traffic)
        except CollisionError:
            # Another content under this key (another formation context): keep the first,
            # the window uses the patch it has in hand.
            return None
        except (StoreError, OSError) as e:
            return f"patch {key[:24]} not stored ({type(e).__name__}: {e})"
        return None

    # ------------------------------------------------------------------ residency
    def reserve_working_set(self, owner: str, nbytes: int, device: torch.device | str) -> str | None:
        """Count ``nbytes`` a window keeps outside the store on ``device`` (its placed pages)
        against the budget of the store's fastest memory tier there (`MemoryTier.reserve`), so
        the store and its windows together stay within the memory budget; 0 gives it back.
        Returns the tier's name, or None when no memory tier lives on ``device``."""
        dev = torch.device(device)
        for t in self.store.tiers:
            if isinstance(t, MemoryTier) and t.device == dev:
                t.reserve(owner, nbytes)
                return t.name
        return None

    def hold(self, keys: Iterable[str], traffic: TierTraffic) -> list[str]:
        """Count a window slot holding each key; a held key is brought to the fastest tier, and
        leased in the shared tiers (`TieredStore.lease`) while any window holds it.

        Never raises for a store fault: promotion is best effort (a key a faulty tier cannot
        promote stays where it is, still held). Returns one line per promotion or pin that failed."""
        failed: list[str] = []
        first: list[str] = []
        for key in keys:
            self._holds[key] += 1
            if self._holds[key] == 1:
                first.append(key)
                self._undemoted.pop(key, None)
                try:
                    where = self.store.where(key)
                    if where and where[0] != self.store.tiers[0].name:
                        self.store.get(key, traffic=traffic)  # promotes
                except (StoreError, OSError) as e:
                    failed.append(f"promotion of {key[:24]} failed ({type(e).__name__}: {e}); it stays where it is")
        failed += self._lease(first, traffic, take=True)
        return failed

    def holds(self, key: str) -> int:
        """How many holds ``key`` has (0: nobody holds it)."""
        return self._holds.get(key, 0)

    def release(self, keys: Iterable[str], traffic: TierTraffic) -> list[str]:
        """Undo one hold per key; keys nobody holds any more are demoted one tier down.

        Never raises for a store fault: a demotion a faulty tier refuses leaves the entry where it
        is (nothing is lost) and is retried at the next release. Shared-tier leases on keys nobody
        holds any more are let go. Returns one line per failure."""
        failed: list[str] = []
        last: list[str] = []
        for key in keys:
            if self._holds[key] <= 0:
                continue
            self._holds[key] -= 1
            if self._holds[key] == 0:
                del self._holds[key]
                self._undemoted[key] = None
                last.append(key)
        stale = [k for k in self._in_flight if k not in self._holds]
        self._in_flight.clear()
        failed += self._lease(last + [k for k in stale if k not in last], traffic, take=False)
        for key in list(self._undemoted):
            try:
                self.demote(key, traffic)
            except (StoreError, OSError) as e:
                failed.append(f"demotion of {key[:24]} deferred ({type(e).__name__}: {e})")
                continue
            self._undemoted.pop(key, None)
        return failed

    def _lease_in_flight(self, key: str, traffic: TierTraffic) -> None:
        """Lease ``key`` now for the operation in progress (settled by the next ``release``: kept
        if the operation ended up holding it, else let go)."""
        if key in self._holds or key in self._in_flight:
            return
        self._in_flight.add(key)
        self._lease([key], traffic, take=True)

    def _lease(self, keys: list[str], traffic: TierTraffic, *, take: bool) -> list[str]:
        """Take (or let go of) shared-tier leases on ``keys``; never raises for a store fault (a
        lease is bookkeeping for other processes: the window works without it)."""
        if not keys:
            return []
        try:
            with recording(traffic):  # a shared tier that is away says so in the receipt
                (self.store.lease if take else self.store.unlease)(keys)
        except (StoreError, OSError) as e:
            return [f"{'lease' if take else 'unlease'} of {len(keys)} keys failed ({type(e).__name__}: {e})"]
        return []

    def demote(self, key: str, traffic: TierTraffic) -> bool:
        """Move ``key`` one tier down (never dropped; see ``TieredStore.demote``)."""
        return self.store.demote(key, traffic=traffic)

    def tier_of(self, key: str) -> str | None:
        """Name of the fastest tier holding ``key`` (None: not stored)."""
        where = self.store.where(key)
        return where[0] if where else None
