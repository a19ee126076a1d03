"""`Prefetcher`: load store entries from the slower tiers in the background (MPIC section 3.2).

A caller that knows which entries it will need (a window materializing chunks that sit in host
memory, on disk or in a remote tier) submits their keys; worker threads read them from the
fastest tier holding them while the caller's own thread runs the model on what must be computed.
Reads go straight to the tier (every tier is thread-safe for reads), outside the store's lock,
so they never stall the caller's own store operations. A read that fails — corrupt file,
unreadable directory, entry of another model, a remote tier away — is not raised in the worker:
the :class:`Fetched` result carries the error, and the caller decides (recompute, typically).

``settle`` then does on the caller's thread what ``TieredStore.get`` would have done on a hit:
count the read in the caller's `TierTraffic` and promote the entry into the faster tiers
(``TieredStore.promote``, the very code ``get`` promotes with).

The unit is the entry: our disk format verifies a checksum over a whole entry before any of its
tensors is trusted, so an entry cannot be consumed layer by layer as it streams in.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from contextdeque.stores.base import StoreEntry
from contextdeque.stores.tiered import TieredStore
from contextdeque.stores.traffic import TierTraffic


@dataclass
class Fetched:
    """One background read: the ``entry`` (None: no tier holds the key, or the read failed),
    the ``tier`` that served it (or failed), its ``index`` in the store, the wall ``seconds``
    the read took, when it ``started`` / ``ended`` (``time.perf_counter``), and the ``error``
    that stopped it (None on success)."""

    key: str
    entry: StoreEntry | None
    tier: str | None
    index: int
    seconds: float
    started: float
    ended: float
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.entry is not None and self.error is None


def fetch(store: TieredStore, key: str, *, expect_fingerprint: str | None = None,
          expect_layout: str | None = None) -> Fetched:
    """Read ``key`` from the fastest tier holding it, directly (no store lock, no promotion).

    Never raises for a failed read: the error is returned in the result."""
    t0 = time.perf_counter()
    tier_name, index = None, -1
    try:
        for i, tier in enumerate(store.tiers):
            tier_name, index = tier.name, i
            entry = tier.get(key, expect_fingerprint=expect_fingerprint, expect_layout=expect_layout)
            if entry is not None:
                t1 = time.perf_counter()
                return Fetched(key, entry, tier.name, i, t1 - t0, t0, t1)
        t1 = time.perf_counter()
        return Fetched(key, None, None, -1, t1 - t0, t0, t1)
    except Exception as exc:  # the caller falls back; the error travels with the result
        t1 = time.perf_counter()
        return Fetched(key, None, tier_name, index, t1 - t0, t0, t1, error=exc)


def settle(store: TieredStore, fetched: Fetched, traffic: TierTraffic | None = None) -> StoreEntry | None:
    """On the caller's thread: count a successful background read as a hit on its tier and
    promote the entry into the faster tiers (``TieredStore.promote``). Returns the entry (the
    promoted copy), or None for a failed read."""
    if not fetched.ok:
        return None
    assert fetched.entry is not None
    return store.promote(fetched.key, fetched.entry, fetched.index, traffic=traffic)


class Prefetcher:
    """Background reads of store entries: ``submit(key)`` returns a ``Future[Fetched]``.

    ``workers``: reader threads (1 reads entries one after another, in submission order, beside
    the caller's thread). Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, store: TieredStore, workers: int = 1) -> None:
        if not isinstance(store, TieredStore):
            raise TypeError(f"a Prefetcher reads from a TieredStore, got {type(store).__name__}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an int >= 1, got {workers!r}")
        self.store = store
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cdq-prefetch")

    def submit(self, key: str, **expect: Any) -> "Future[Fetched]":
        """Start reading ``key`` (``expect_fingerprint=`` / ``expect_layout=`` are checked)."""
        return self._pool.submit(fetch, self.store, key, **expect)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
