"""The window's view of a ``TieredStore``: chunks and patches as store entries, residency.

Canonicals and patches live in the store, content-addressed (``chunk_key`` / ``patch_key``).
While any window (or fork) holds a chunk in its slots, its canonical and patches stay in the
fastest tier; when the last holder lets go (evict, slide), they are *demoted* one tier down
(device -> host -> disk), never dropped by the window.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import TYPE_CHECKING, Any, Iterable

import torch

from ..core.chunk import Chunk
from ..core.errors import ArgumentTypeError, CollisionError, StoreError
from ..patch import Patch
if TYPE_CHECKING:  # pragma: no cover
    from ..model.vision import ImageEmbedding

from ..stores import HostTier, MemoryTier, StoreEntry, Tier, TieredStore, TierTraffic, chunk_key, embeds_key
from ..stores.traffic import recording

_ADAPTERS: "weakref.WeakKeyDictionary[TieredStore, WindowStore]" = weakref.WeakKeyDictionary()


def default_store(device: torch.device | str) -> TieredStore:
    """Two unbounded in-memory tiers: ``device`` (where the model runs) and ``host`` (CPU)."""
    return TieredStore([MemoryTier(device, None, name="device"), HostTier(None, name="host")])


class WindowStore:
    """Chunk/patch access and residency bookkeeping over one ``TieredStore``.

    One adapter per store object (:meth:`wrap` memoizes), so every window and fork sharing a
    store shares the hold counts that decide demotion.
    """

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self._holds: Counter[str] = Counter()
        #: keys released by every holder whose demotion a store fault refused (retried on release)
        self._undemoted: set[str] = set()
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

    def has(self, key: str) -> bool:
        return self.store.contains(key)

    def get_chunk(self, key: str, *, fingerprint: str, layout: str, traffic: TierTraffic) -> Chunk | None:
        """The canonical under ``key`` (promoted to the fastest tier), or None.

        A copy failing verification is quarantined (``traffic.quarantined``) and the next tier's
        copy served, or None: the window then rebuilds it from its source.
        Raises FingerprintMismatchError for an entry another model or layout wrote."""
        entry = self.store.get(key, expect_fingerprint=fingerprint, expect_layout=layout, corrupt_ok=True, traffic=traffic)
        self._count("chunk", traffic)
        if entry is None:
            return None
        return Chunk.from_entry(dict(entry.tensors), dict(entry.meta))

    def put_chunk(self, chunk: Chunk, *, traffic: TierTraffic) -> str:
        """Store ``chunk`` (a no-op when already there); returns its key."""
        key = self.chunk_key(chunk)
        tensors, meta = chunk.to_entry()
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
    def hold(self, keys: Iterable[str], traffic: TierTraffic) -> list[str]:
        """Count a window slot holding each key; a held key is brought to the fastest tier, and
        leased in the shared tiers (`TieredStore.lease`) while any window holds it.

        Never raises for a store fault: promotion is best effort (a key a faulty tier cannot
        promote stays where it is, still held). Returns one line per promotion that failed."""
        failed: list[str] = []
        first: list[str] = []
        for key in keys:
            self._holds[key] += 1
            if self._holds[key] == 1:
                first.append(key)
                self._undemoted.discard(key)
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
                self._undemoted.add(key)
                last.append(key)
        failed += self._lease(last, traffic, take=False)
        for key in sorted(self._undemoted):
            try:
                self.demote(key, traffic)
            except (StoreError, OSError) as e:
                failed.append(f"demotion of {key[:24]} deferred ({type(e).__name__}: {e})")
                continue
            self._undemoted.discard(key)
        return failed

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
