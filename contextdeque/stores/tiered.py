"""`TieredStore`: device -> host -> disk, promotion on use and spill-down on eviction."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from contextdeque.core.errors import (
    ArgumentTypeError,
    CollisionError,
    CorruptEntryError,
    StoreCapacityError,
    StoreConfigError,
    StoreError,
    StoreUnavailableError,
    UnknownTierError,
)
from contextdeque.stores.base import Evicted, StoreEntry, Tier, check_collision
from contextdeque.stores.traffic import TierTraffic, recording

# A tier that cannot take an entry right now: too full, or (a remote tier) away.
_NOT_TAKEN = (StoreCapacityError, StoreUnavailableError)


class TieredStore:
    """An ordered list of tiers, fastest first (e.g. ``[MemoryTier, HostTier, DiskTier]``).

    - ``get`` searches top-down; a hit below the top is copied into every upper tier
      (promotion), and the copy from the highest tier it reached is returned.
    - ``put`` writes into the top tier (the first one whose budget can hold the entry),
      and with ``write_through`` also into every persistent tier below it.
    - Whatever a tier evicts to make room spills into the next tier down (unless that tier
      already holds the key); only when no lower tier can take it is it dropped, and the
      drop is reported in `TierTraffic.dropped`.
    - Every operation records a `TierTraffic` (``last_traffic``; accumulated in
      ``total_traffic``; also merged into the ``traffic=`` record a caller passes). With
      ``journal`` a list, each one that moved bytes is also appended to it, as
      ``(operation, key, traffic)``: where two stacks' totals differ, the first entry that
      differs says which key went another way (``scripts/replay_vs_window.py --diverge``).
    - A remote tier that is away (e.g. `ValkeyTier` unreachable) answers reads as misses
      and refuses writes with `StoreUnavailableError`: the operation goes on with the other
      tiers, and the record's ``fallbacks`` says so.

    Copies in the tiers are shared read-only: never modify returned tensors in place.

    Args:
        tiers: the tiers, fastest first; names must be unique.
        write_through: default for ``put(write_through=...)``.
    """

    def __init__(self, tiers: Sequence[Tier], *, write_through: bool = False) -> None:
        if isinstance(tiers, (str, bytes, Tier)) or not isinstance(tiers, Sequence):
            raise ArgumentTypeError(f"tiers must be a list of tiers (fastest first), got {type(tiers).__name__}")
        tiers = list(tiers)
        if not tiers:
            raise StoreConfigError("tiers is empty: a TieredStore needs at least one tier")
        for i, t in enumerate(tiers):
            if not isinstance(t, Tier):
                raise ArgumentTypeError(f"tiers[{i}] must be a Tier (MemoryTier, HostTier, DiskTier, ...), got {type(t).__name__}")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise StoreConfigError(f"tier names must be unique, got {names}")
        if not isinstance(write_through, bool):
            raise ArgumentTypeError(f"write_through must be a bool, got {type(write_through).__name__}")
        self._tiers = tiers
        self.write_through = write_through
        self._pins: set[str] = set()
        self._leased: set[str] = set()  # keys this process holds (see `lease`)
        self._lock = threading.RLock()
        self.last_traffic = TierTraffic()
        self.total_traffic = TierTraffic()
        self.journal: list[tuple[str, str, TierTraffic]] | None = None

    # ------------------------------------------------------------------ introspection

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers, fastest first."""
        return tuple(self._tiers)

    def tier(self, name: str) -> Tier:
        """The tier called ``name``."""
        for t in self._tiers:
            if t.name == name:
                return t
        raise UnknownTierError(f"no tier named {name!r}; tiers: {[t.name for t in self._tiers]}")

    def where(self, key: str) -> list[str]:
        """Names of the tiers holding ``key``, fastest first."""
        return [t.name for t in self._tiers if t.contains(key)]

    def contains(self, key: str) -> bool:
        """Whether any tier holds ``key``."""
        return any(t.contains(key) for t in self._tiers)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.contains(key)

    def keys(self) -> set[str]:
        """Keys held by any tier."""
        out: set[str] = set()
        for t in self._tiers:
            out.update(t.keys())
        return out

    def nbytes(self) -> dict[str, int]:
        """Tier name -> bytes counted against its budget."""
        return {t.name: t.nbytes() for t in self._tiers}

    def budget_bytes(self) -> dict[str, int | None]:
        """Tier name -> byte budget (None: unbounded)."""
        return {t.name: t.budget_bytes for t in self._tiers}

    def peek(self, key: str) -> Mapping[str, str] | None:
        """Metadata of the fastest copy of ``key`` (no tensors loaded, no promotion)."""
        for t in self._tiers:
            m = t.peek(key)
            if m is not None:
                return m
        return None

    # ------------------------------------------------------------------ traffic

    @contextmanager
    def _op(self, traffic: TierTraffic | None, op: str, key: str) -> Iterator[TierTraffic]:
        tr = TierTraffic()
        with self._lock, recording(tr):
            try:
                yield tr
            finally:
                self.last_traffic = tr
                self.total_traffic.merge(tr)
                if self.journal is not None and (tr.read or tr.written or tr.evicted):
                    self.journal.append((op, key, tr))
                if traffic is not None:
                    traffic.merge(tr)

    # ------------------------------------------------------------------ operations

    def get(
        self,
        key: str,
        *,
        expect_fingerprint: str | None = None,
        expect_layout: str | None = None,
        expect_digest: str | None = None,
        corrupt_ok: bool = False,
        promote: bool = True,
        traffic: TierTraffic | None = None,
    ) -> StoreEntry | None:
        """The entry under ``key`` from the fastest tier holding it, or None.

        Args:
            expect_fingerprint / expect_layout: refuse an entry recorded for another model
                fingerprint / layout (`FingerprintMismatchError`).
            expect_digest: refuse an entry with another ``content_digest`` (`CollisionError`).
            corrupt_ok: a copy failing verification is set aside (a disk tier moves the file into
                its ``quarantine/`` folder; recorded in the traffic's ``quarantined``) and the
                search goes on to slower tiers (None if no good copy); otherwise `CorruptEntryError`.
            promote: copy a hit into the faster tiers.
            traffic: a record to add this operation's traffic to.
        """
        with self._op(traffic, "get", key) as tr:
            entry: StoreEntry | None = None
            found = -1
            for i, tier in enumerate(self._tiers):
                expect = dict(expect_fingerprint=expect_fingerprint, expect_layout=expect_layout, expect_digest=expect_digest)
                try:
                    entry = tier.get(key, **expect)
                except CorruptEntryError:
                    if not corrupt_ok:
                        raise
                    entry = tier.get(key, **expect, corrupt_ok=True)  # the tier sets the bad copy aside
                    if entry is None:
                        tr.quarantined.append(f"{tier.name}:{key}")
                if entry is not None:
                    found = i
                    break
            if entry is None:
                tr.add_miss()
                return None
            tr.add_read(self._tiers[found].name, entry.nbytes)
            if promote and found > 0:
                entry = self._promote(key, entry, found, tr)
            return entry

    def promote(self, key: str, entry: StoreEntry, found: int, *, traffic: TierTraffic | None = None) -> StoreEntry:
        """Copy ``entry``, just read from tier ``found`` outside the store (e.g. by a
        `Prefetcher`), into every faster tier, as ``get`` does on a hit; returns the copy from the
        highest tier it reached. Counts the read from tier ``found``."""
        with self._op(traffic, "promote", key) as tr:
            tr.add_read(self._tiers[found].name, entry.nbytes)
            return self._promote(key, entry, found, tr) if found > 0 else entry

    def _promote(self, key: str, entry: StoreEntry, found: int, tr: TierTraffic) -> StoreEntry:
        priority = self._tiers[found].priority_of(key)
        top = found
        for j in range(found - 1, -1, -1):
            if self._place(j, key, entry, priority, key in self._pins, tr):
                top = j
        if top < found:
            promoted = self._tiers[top].get(key)
            if promoted is not None:
                return promoted
        return entry

    def put(
        self,
        key: str,
        entry: StoreEntry,
        *,
        pinned: bool = False,
        priority: int = 0,
        overwrite: bool = False,
        write_through: bool | None = None,
        traffic: TierTraffic | None = None,
    ) -> None:
        """Store ``entry`` under ``key`` in the top tier that can hold it.

        Args:
            pinned: pin the key (in every tier it reaches) until `unpin`.
            priority: eviction priority (used by priority-aware policies; higher stays longer).
            overwrite: replace whatever ``key`` holds in every tier (skips the collision guard).
            write_through: also write into every persistent tier below (default: the
                store's ``write_through``).
            traffic: a record to add this operation's traffic to.

        Raises:
            CollisionError: some tier holds ``key`` with another ``content_digest``.
            StoreCapacityError: no tier can hold the entry.
        """
        entry.user_meta_check()
        with self._op(traffic, "put", key) as tr:
            if not overwrite:
                for t in self._tiers:
                    try:
                        meta = t.peek(key)
                    except CorruptEntryError:
                        continue  # garbage is replaced, never compared
                    if meta is not None and not check_collision(key, meta, entry.meta):
                        overwrite = True  # no digests to compare: replace every copy
            if overwrite:
                for t in self._tiers:
                    t.delete(key)
            err: StoreCapacityError | None = None
            placed = -1
            for j, tier in enumerate(self._tiers):
                try:
                    self._put_into(j, key, entry, priority, pinned, tr, copy=True)
                except _NOT_TAKEN as e:
                    err = e
                    continue
                placed = j
                break
            if placed < 0:
                raise StoreCapacityError(f"no tier of the store can hold {key!r} ({entry.nbytes} B)") from err
            wt = self.write_through if write_through is None else write_through
            if wt:
                for j in range(placed + 1, len(self._tiers)):
                    if self._tiers[j].persistent and not self._tiers[j].contains(key):
                        try:
                            self._put_into(j, key, entry, priority, pinned, tr, copy=True)
                        except StoreUnavailableError:
                            continue  # away: the entry stays in the tiers above (counted)
            if pinned:
                self.pin(key)  # also in lower tiers that already held it

    def delete(self, key: str, *, traffic: TierTraffic | None = None) -> bool:
        """Remove ``key`` from every tier (pinned or not); True if any held it."""
        with self._op(traffic, "delete", key):
            self._pins.discard(key)
            hit = False
            for t in self._tiers:
                hit = t.delete(key) or hit
            return hit

    def demote(self, key: str, *, to: str | None = None, traffic: TierTraffic | None = None) -> bool:
        """Move ``key`` from the fastest tier holding it down to the next tier (or to ``to``).

        The entry is written into the first tier at or below the target that can take it
        (victims spill further down as usual; a tier already holding the key counts as
        placed), then every copy above that tier is removed (pins there included; the
        store-level pin still applies to later promotions). Never drops the entry: if no
        lower tier can take it, it stays where it is.

        Returns:
            True when it moved; False when absent, already in the slowest tier (or at/below
            ``to``), or no lower tier could take it.

        Raises:
            KeyError: ``to`` names no tier.
            CorruptEntryError: the copy to move fails verification.
        """
        with self._op(traffic, "demote", key) as tr:
            top = next((i for i, t in enumerate(self._tiers) if t.contains(key)), None)
            if top is None:
                return False
            start = top + 1 if to is None else self._tiers.index(self.tier(to))
            if start <= top or start >= len(self._tiers):
                return False
            entry = self._tiers[top].get(key)
            if entry is None:
                return False
            priority = self._tiers[top].priority_of(key)
            home = -1
            for j in range(start, len(self._tiers)):
                if self._tiers[j].contains(key):
                    home = j
                    break
                try:
                    self._put_into(j, key, entry, priority, key in self._pins, tr, copy=False)
                except (*_NOT_TAKEN, CollisionError):
                    continue
                home = j
                break
            if home < 0:
                return False
            tr.add_read(self._tiers[top].name, entry.nbytes, hit=False)
            for i in range(home):
                if self._tiers[i].delete(key):
                    tr.add_evicted(self._tiers[i].name, entry.nbytes)
            return True

    def pin(self, key: str) -> bool:
        """Pin ``key`` in every tier holding it, and in the tiers it is promoted into later.

        Returns False (and pins nothing) when no tier holds it.
        """
        with self._lock:
            hit = False
            for t in self._tiers:
                hit = t.pin(key) or hit
            if hit:
                self._pins.add(key)
            return hit

    def unpin(self, key: str) -> bool:
        """Make ``key`` evictable again everywhere; False if it was not pinned."""
        with self._lock:
            was = key in self._pins
            self._pins.discard(key)
            for t in self._tiers:
                was = t.unpin(key) or was
            return was

    def lease(self, keys: "list[str] | tuple[str, ...]") -> None:
        """Tell the shared tiers this process holds ``keys`` (see `Tier.lease`); local tiers
        are untouched (a lease is not a pin: it never blocks local eviction). A remote tier
        (`ValkeyTier`) leases them at once, stored or not; a `DiskTier` leases those it holds now
        and, while they stay leased, any that is written into it later (spill, demotion,
        promotion, write-through): a directory only other processes' budgets can evict from
        needs the lease only while it holds the entry, and the window pays no file I/O for
        entries that live in memory."""
        keys = list(keys)
        with self._lock:
            self._leased.update(keys)
            for t in self._tiers:
                if t.remote:
                    t.lease(keys)
                else:
                    here = [k for k in keys if t.contains(k)]
                    if here:
                        t.lease(here)

    def unlease(self, keys: "list[str] | tuple[str, ...]") -> None:
        """Undo `lease` for ``keys``."""
        keys = list(keys)
        with self._lock:
            self._leased.difference_update(keys)
            for t in self._tiers:
                t.unlease(keys)

    def is_pinned(self, key: str) -> bool:
        """Whether ``key`` is pinned by this store."""
        with self._lock:
            return key in self._pins

    # ------------------------------------------------------------------ placement

    def _put_into(
        self, j: int, key: str, entry: StoreEntry, priority: int, pinned: bool, tr: TierTraffic, *, copy: bool
    ) -> None:
        """Put into tier ``j`` and spill its victims down (StoreCapacityError propagates)."""
        tier = self._tiers[j]
        if key in self._leased and not tier.remote:
            tier.lease([key])  # before it lands: no other process evicts it in between
        res = tier.put(
            key, entry, pinned=pinned, priority=priority,
            keep_evicted=j + 1 < len(self._tiers), copy=copy,
        )
        if res.stored:
            tr.add_written(tier.name, entry.nbytes)
        pending = list(res.evicted)
        try:
            while pending:
                tr.add_evicted(tier.name, pending[0].nbytes)
                self._spill(j + 1, pending[0], tr)
                pending.pop(0)
        except BaseException:
            # A lower tier failed (read-only, full disk, I/O error) while taking a victim: undo
            # this put so that no entry is lost: the new entry leaves tier j again and the
            # victims not yet placed below come back (they fit: they were there before).
            if res.stored:
                tier.delete(key)
            for ev in pending:
                if ev.entry is not None and not tier.contains(ev.key):
                    tier.put(ev.key, ev.entry, priority=ev.priority, copy=False)
            raise

    def _place(self, j: int, key: str, entry: StoreEntry, priority: int, pinned: bool, tr: TierTraffic) -> bool:
        """Promotion into tier ``j``: best effort (a full, conflicting or failing tier is skipped:
        the entry is still served from where it was found)."""
        try:
            self._put_into(j, key, entry, priority, pinned, tr, copy=False)
        except (StoreError, OSError):
            return False
        return True

    def _spill(self, level: int, ev: Evicted, tr: TierTraffic) -> None:
        """Move an evicted entry into the first tier at or below ``level`` that takes it."""
        for j in range(level, len(self._tiers)):
            tier = self._tiers[j]
            if tier.contains(ev.key):
                return  # a lower copy already exists: nothing is lost, nothing to move
            if ev.entry is None:
                break
            try:
                self._put_into(j, ev.key, ev.entry, ev.priority, False, tr, copy=False)
            except _NOT_TAKEN:
                continue  # too big, full of pinned entries, or away: try further down
            except CollisionError:
                return  # another version was written there meanwhile; it wins
            return
        # Any other failure (StorePermissionError, StoreWriteError) propagates: ``_put_into``
        # undoes the put that evicted this entry rather than lose it.
        tr.dropped.append(ev.key)

    def __repr__(self) -> str:
        return f"TieredStore({self._tiers!r}, write_through={self.write_through})"
