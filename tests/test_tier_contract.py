"""The tier contract is written once in `Tier`: a tier implements only its primitives.

A dictionary-backed tier written here, with nothing but the primitives, gets `get` / `put`
argument handling, the expectations, the collision guard's use, eviction by the tier's policy,
and leases with their renewer from the base class, and works inside a `TieredStore`."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import pytest
import torch

from contextdeque.core.errors import (
    CollisionError,
    FingerprintMismatchError,
    InvalidEntryError,
    StoreCapacityError,
)
from contextdeque.stores import TIERS, EntryStat, Evicted, PutResult, StoreEntry, Tier, TieredStore
from contextdeque.stores.base import Expect, PutRequest, check_collision


class DictTier(Tier):
    """Entries in a dict: only the primitives (no ``kind``: not registered)."""

    def __init__(self, budget_bytes: int | None = None, *, shared: bool = False, renew_s: float | None = None) -> None:
        super().__init__(name="dict", budget_bytes=budget_bytes, policy="lru")
        self.entries: dict[str, tuple[StoreEntry, int]] = {}
        self.pins: set[str] = set()
        self.clock = 0
        self.shared = shared
        self.renew_s = renew_s
        self.taken: list[str] = []
        self.dropped: list[str] = []
        self.renewals = 0

    def _read(self, key: str, expect: Expect, corrupt_ok: bool) -> StoreEntry | None:
        hit = self.entries.get(key)
        if hit is None:
            return None
        expect.check(key, hit[0].meta)
        self.clock += 1
        self.entries[key] = (hit[0], self.clock)
        return hit[0]

    def _write(self, key: str, entry: StoreEntry, request: PutRequest) -> PutResult:
        old = self.entries.get(key)
        if old is not None and not request.overwrite and check_collision(key, old[0].meta, entry.meta):
            return PutResult(stored=False)
        used = sum(e.nbytes for k, (e, _) in self.entries.items() if k != key)
        over = used + entry.nbytes - (self.budget_bytes if self.budget_bytes is not None else used + entry.nbytes)
        cands = [EntryStat(k, e.nbytes, t) for k, (e, t) in self.entries.items() if k != key and k not in self.pins]
        victims = self.choose_victims(key, over, cands, f"{used} B used")
        evicted = tuple(Evicted(k, self.entries[k][0].nbytes, 0, self.entries.pop(k)[0]) for k in victims)
        self.clock += 1
        self.entries[key] = (entry, self.clock)
        if request.pinned:
            self.pins.add(key)
        return PutResult(stored=True, evicted=evicted)

    def peek(self, key: str) -> Mapping[str, str] | None:
        hit = self.entries.get(key)
        return None if hit is None else hit[0].meta

    def delete(self, key: str) -> bool:
        self.pins.discard(key)
        return self.entries.pop(key, None) is not None

    def contains(self, key: str) -> bool:
        return key in self.entries

    def keys(self) -> list[str]:
        return list(self.entries)

    def nbytes(self) -> int:
        return sum(e.nbytes for e, _ in self.entries.values())

    def priority_of(self, key: str) -> int:
        return 0

    def pin(self, key: str) -> bool:
        if key not in self.entries:
            return False
        self.pins.add(key)
        return True

    def unpin(self, key: str) -> bool:
        was = key in self.pins
        self.pins.discard(key)
        return was

    def is_pinned(self, key: str) -> bool:
        return key in self.pins

    def _take_leases(self, keys: list[str]) -> None:
        self.taken += keys

    def _drop_leases(self, keys: list[str]) -> None:
        self.dropped += keys

    @property
    def renew_every_s(self) -> float | None:
        return self.renew_s

    def renew_leases(self) -> int:
        self.renewals += 1
        return len(self.leased())


def entry(i: int, n: int = 4, **meta: str) -> StoreEntry:
    return StoreEntry({"x": torch.full((n,), float(i))}, meta)


def test_the_registered_tiers_inherit_the_contract():
    """No tier restates `get` / `put`, the victim choice or the lease bookkeeping."""
    assert {"memory", "host", "disk", "valkey", "capsule"} <= set(TIERS)
    for kind, cls in TIERS.items():
        for name in ("get", "put", "lease", "unlease", "leased", "choose_victims", "_keep_renewing"):
            assert getattr(cls, name) is getattr(Tier, name), f"{kind} overrides Tier.{name}"
    assert DictTier not in set(TIERS.values())  # a tier without a kind is not registered


def test_argument_handling_and_expectations_come_from_the_base():
    t = DictTier()
    with pytest.raises(TypeError):
        t.put(3, entry(0))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        t.get(b"k")  # type: ignore[arg-type]
    with pytest.raises(InvalidEntryError):
        t.put("k", {"x": torch.ones(2)})  # type: ignore[arg-type]
    with pytest.raises(InvalidEntryError):
        t.put("k", entry(0, **{"cdq.key": "mine"}))
    assert t.put("k", entry(1, fingerprint="fp", content_digest="d1")).stored
    assert not t.put("k", entry(1, fingerprint="fp", content_digest="d1")).stored  # same content: no write
    with pytest.raises(CollisionError):
        t.put("k", entry(2, fingerprint="fp", content_digest="d2"))
    assert t.put("k", entry(2, fingerprint="fp", content_digest="d2"), overwrite=True).stored
    with pytest.raises(FingerprintMismatchError):
        t.get("k", expect_fingerprint="other")
    with pytest.raises(CollisionError):
        t.get("k", expect_digest="d1")
    assert float(t.get("k", expect_fingerprint="fp", expect_digest="d2").tensors["x"][0]) == 2.0
    assert t.verify("k") and "k" in t and not t.verify("absent")


def test_eviction_follows_the_policy_and_spares_pins():
    t = DictTier(budget_bytes=3 * 16)
    for i in range(3):
        t.put(f"k{i}", entry(i), pinned=i == 0)
    t.get("k1")  # k2 is now the least recently used unpinned entry
    res = t.put("k3", entry(3))
    assert [ev.key for ev in res.evicted] == ["k2"] and res.evicted[0].entry is not None
    t.pin("k1")
    t.pin("k3")
    with pytest.raises(StoreCapacityError, match="the rest is pinned"):
        t.put("k4", entry(4))
    assert sorted(t.keys()) == ["k0", "k1", "k3"]


def test_a_primitives_only_tier_works_in_a_store():
    top, low = DictTier(budget_bytes=2 * 16), DictTier(budget_bytes=None)
    low.name = "low"
    store = TieredStore([top, low])
    for i in range(3):
        store.put(f"k{i}", entry(i))
    assert store.where("k0") == ["low"] and store.where("k2") == ["dict"]  # k0 spilled down
    assert float(store.get("k0").tensors["x"][0]) == 0.0 and store.where("k0") == ["dict", "low"]


def test_leases_only_on_a_shared_tier_and_once_per_key():
    local = DictTier()
    local.lease(["a", "b"])
    assert local.leased() == set() and local.taken == []  # a local tier has nobody to tell
    shared = DictTier(shared=True)
    shared.lease(["a", "b", "a"])
    shared.lease(["b", "c"])
    assert shared.taken == ["a", "b", "c"] and shared.leased() == {"a", "b", "c"}
    shared.unlease(["a", "zz"])
    assert shared.dropped == ["a"] and shared.leased() == {"b", "c"}


def test_the_renewer_runs_while_leases_lapse_and_stops_at_close():
    t = DictTier(shared=True, renew_s=0.02)
    t.lease(["a"])
    renewers = [th for th in threading.enumerate() if th.name == "abstract-lease-renewer-dict"]
    assert len(renewers) == 1
    deadline = time.monotonic() + 5
    while t.renewals < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.renewals >= 2
    t.lease(["b"])  # one renewer per tier
    assert len([th for th in threading.enumerate() if th.name == "abstract-lease-renewer-dict"]) == 1
    t.close()
    renewers[0].join(timeout=5)
    assert not renewers[0].is_alive()
    never = DictTier(shared=True, renew_s=None)
    never.lease(["a"])
    assert never._renewer is None  # leases that never lapse need no renewer
