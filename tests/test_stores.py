"""Tests of contextdeque.stores: tiers, eviction, promotion/spill, disk safety, processes."""

from __future__ import annotations

import ast
import inspect
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from contextdeque.core.errors import (
    CollisionError,
    CorruptEntryError,
    FingerprintMismatchError,
    InvalidEntryError,
    StoreCapacityError,
    StorePermissionError,
)
from contextdeque.stores import (
    POLICIES,
    DiskTier,
    EvictionPolicy,
    HostTier,
    MemoryTier,
    StoreEntry,
    StoreKey,
    TieredStore,
    TierTraffic,
    chunk_key,
    embeds_key,
    make_tier,
)
from contextdeque.stores.disk import key_digest

STORES_DIR = Path(__file__).resolve().parents[1] / "contextdeque" / "stores"


# ----------------------------------------------------------------------------- helpers


def make_entry(version: int, nbytes: int, fingerprint: str = "fp-A") -> StoreEntry:
    """Deterministic entry of about ``nbytes`` payload bytes; content is a function of version."""
    g = torch.Generator().manual_seed(version)
    n = max(nbytes // 4 - 64, 1)
    x = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int32)
    y = torch.randn(4, 16, generator=g).to(torch.bfloat16)
    meta = {
        "fingerprint": fingerprint,
        "layout": "gqa:h4:d16",
        "kind": "chunk",
        "version": str(version),
        "content_digest": f"digest-{version:08d}",
    }
    return StoreEntry({"x": x, "y": y}, meta)


def same(a: StoreEntry, b: StoreEntry) -> bool:
    if dict(a.meta) != dict(b.meta) or set(a.tensors) != set(b.tensors):
        return False
    return all(
        a.tensors[n].dtype == b.tensors[n].dtype
        and a.tensors[n].shape == b.tensors[n].shape
        and torch.equal(a.tensors[n].cpu(), b.tensors[n].cpu())
        for n in a.tensors
    )


def small(i: int, numel: int = 25, **meta: str) -> StoreEntry:
    """A 4*numel-byte entry; keys/values of equal length so disk files have equal sizes."""
    m = {"fingerprint": "fp-A", "layout": "L1", "kind": "chunk", "content_digest": f"d{i:04d}"}
    m.update(meta)
    return StoreEntry({"x": torch.full((numel,), float(i))}, m)


def disk_file_size(tmp_path: Path, entry: StoreEntry, key: str = "k0000") -> int:
    probe = DiskTier(tmp_path / "probe", None)
    probe.put(key, entry)
    return probe.nbytes()


TIER_KINDS = ["memory", "host", "disk"]


def new_tier(kind: str, tmp_path: Path, budget: int | None, policy: str = "lru", name: str | None = None):
    if kind == "memory":
        return MemoryTier("cpu", budget, policy=policy, name=name or "device")
    if kind == "host":
        return HostTier(budget, policy=policy, name=name or "host")
    return DiskTier(tmp_path / (name or "disk"), budget, policy=policy, name=name or "disk")


def unit_budget(kind: str, tmp_path: Path, n_entries: float) -> int:
    """Budget that holds ``n_entries`` `small` entries in this tier's units."""
    unit = disk_file_size(tmp_path, small(0)) if kind == "disk" else small(0).nbytes
    return int(unit * n_entries)


# ----------------------------------------------------------------------------- keys


def test_keys_are_stable_and_injective() -> None:
    assert chunk_key("fp", "abc") == "chunk/fp/abc"
    assert embeds_key("fp", "abc") == "embeds/fp/abc"
    assert chunk_key("a/b", "c") != chunk_key("a", "b/c")
    assert chunk_key("a%2Fb", "c") != chunk_key("a/b", "c")
    for key in [chunk_key("m/x%", "h h"), str(StoreKey("patch", (chunk_key("f", "h"), "s/1", "exact", "r1-2")))]:
        parsed = StoreKey.parse(key)
        assert str(parsed) == key
    assert StoreKey.parse(chunk_key("a/b", "c")).parts == ("a/b", "c")


def test_entry_validation() -> None:
    e = small(1)
    assert e.nbytes == 100 and e.fingerprint == "fp-A" and e.layout == "L1" and e.kind == "chunk"
    assert e.content_digest == "d0001"
    with pytest.raises(InvalidEntryError):
        StoreEntry({"x": [1, 2]}, {})  # type: ignore[dict-item]
    with pytest.raises(InvalidEntryError):
        StoreEntry({"x": torch.zeros(1)}, {"n": 3})  # type: ignore[dict-item]
    with pytest.raises(InvalidEntryError):
        StoreEntry({"__metadata__": torch.zeros(1)}, {})
    with pytest.raises(InvalidEntryError):
        StoreEntry({"x": torch.zeros(2).to_sparse()}, {})
    with pytest.raises(TypeError):
        e.meta["x"] = "y"  # type: ignore[index]
    reserved = StoreEntry({"x": torch.zeros(1)}, {"cdq.key": "spoof"})
    for tier in (MemoryTier("cpu", None), HostTier(None)):
        with pytest.raises(InvalidEntryError):
            tier.put("k", reserved)


# ----------------------------------------------------------------------------- round trips


def rich_entry() -> StoreEntry:
    g = torch.Generator().manual_seed(0)
    return StoreEntry(
        {
            "l0.k": torch.randn(2, 5, 8, generator=g).to(torch.bfloat16),
            "l0.v": torch.randn(2, 5, 8, generator=g).to(torch.float16),
            "u": torch.randn(5, 3, generator=g),
            "w": torch.randn(3, 16, generator=g, dtype=torch.float64),
            "ids": torch.arange(7, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4),
            "view": torch.arange(20, dtype=torch.int16).reshape(4, 5)[:, 1:3],  # non-contiguous
            "fp8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        },
        {"fingerprint": "fp-A", "layout": "gqa", "kind": "patch", "content_digest": "abc", "note": "é ∆ 🙂"},
    )


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_round_trip_per_tier(kind: str, tmp_path: Path) -> None:
    tier = new_tier(kind, tmp_path, None)
    e = rich_entry()
    res = tier.put("chunk/fp-A/h1", e)
    assert res.stored and res.evicted == ()
    got = tier.get("chunk/fp-A/h1")
    assert got is not None and same(got, e)
    assert tier.contains("chunk/fp-A/h1") and "chunk/fp-A/h1" in tier
    assert tier.keys() == ["chunk/fp-A/h1"]
    assert dict(tier.peek("chunk/fp-A/h1") or {}) == dict(e.meta)
    assert tier.get("absent") is None and tier.peek("absent") is None and not tier.verify("absent")
    assert tier.verify("chunk/fp-A/h1")
    if kind == "disk":
        assert tier.nbytes() == sum(p.stat().st_size for p in tier.path.glob("*.safetensors"))
        reopened = DiskTier(tier.path, None)  # nothing but the directory carries state
        again = reopened.get("chunk/fp-A/h1")
        assert again is not None and same(again, e)
        # the file is plain safetensors, readable by anyone, with the metadata in its header
        with safetensors.safe_open(str(tier.file_for("chunk/fp-A/h1")), "pt") as f:
            assert f.metadata()["fingerprint"] == "fp-A"
    else:
        assert tier.nbytes() == e.nbytes
    assert tier.delete("chunk/fp-A/h1") and not tier.delete("chunk/fp-A/h1")
    assert tier.get("chunk/fp-A/h1") is None and tier.nbytes() == 0 and tier.keys() == []


def test_memory_tier_moves_to_device_and_copies() -> None:
    src = torch.arange(6, dtype=torch.float32)
    tier = MemoryTier("meta", None)
    tier.put("k", StoreEntry({"x": src}, {}))
    got = tier.get("k")
    assert got is not None and got.tensors["x"].device.type == "meta" and got.nbytes == 24
    cpu = MemoryTier("cpu", None)
    cpu.put("k", StoreEntry({"x": src}, {}))
    src.add_(100)  # the caller's later in-place change must not reach the store
    got = cpu.get("k")
    assert got is not None and torch.equal(got.tensors["x"], torch.arange(6, dtype=torch.float32))


def test_disk_keys_any_string_is_safe(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", None)
    keys = ["", "../../etc/passwd", "/abs/path", "a\0b", "ünï/cødé 🙂", "x" * 10_000, ".lock", "k.safetensors"]
    for i, k in enumerate(keys):
        tier.put(k, small(i))
    for i, k in enumerate(keys):
        got = tier.get(k)
        assert got is not None and same(got, small(i))
    names = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert names == sorted([".lock"] + [key_digest(k) + ".safetensors" for k in keys])
    assert sorted(tier.keys()) == sorted(keys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


# ----------------------------------------------------------------------------- eviction


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_lru_order(kind: str, tmp_path: Path) -> None:
    tier = new_tier(kind, tmp_path, unit_budget(kind, tmp_path, 3.5))
    for i, k in enumerate("abc"):
        assert tier.put(f"k{k}", small(i)).evicted == ()
    assert tier.get("ka") is not None  # a becomes most recent: b is now least recent
    res = tier.put("kd", small(3))
    assert [e.key for e in res.evicted] == ["kb"]
    assert sorted(tier.keys()) == ["ka", "kc", "kd"]
    assert tier.get("kc") is not None
    res = tier.put("ke", small(4))
    assert [e.key for e in res.evicted] == ["ka"]
    assert res.evicted[0].nbytes == 100
    # a duplicate put (same content_digest) writes nothing but counts as a use
    assert not tier.put("kd", small(3)).stored
    res = tier.put("kf", small(5))
    assert [e.key for e in res.evicted] == ["kc"]
    assert sorted(tier.keys()) == ["kd", "ke", "kf"]
    assert tier.nbytes() <= tier.budget_bytes


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_pinned_entries_are_never_evicted(kind: str, tmp_path: Path) -> None:
    budget = unit_budget(kind, tmp_path, 3.5)
    tier = new_tier(kind, tmp_path, budget)
    tier.put("ka", small(0), pinned=True)
    tier.put("kb", small(1))
    tier.put("kc", small(2))
    assert tier.is_pinned("ka") and not tier.is_pinned("kb")
    for i in range(3, 10):  # ka is the least recently used throughout
        tier.put(f"k{i}", small(i))
        assert "ka" in tier.keys() and tier.nbytes() <= budget
    assert tier.pin("k9") and tier.pin("k8")
    assert not tier.pin("absent")
    before = (sorted(tier.keys()), tier.nbytes())
    with pytest.raises(StoreCapacityError):
        tier.put("kz", small(99))  # everything else is pinned: nothing may be evicted
    assert (sorted(tier.keys()), tier.nbytes()) == before
    assert tier.unpin("k8") and not tier.unpin("k8")
    res = tier.put("kz", small(99))
    assert [e.key for e in res.evicted] == ["k8"]
    with pytest.raises(StoreCapacityError):
        tier.put("huge", small(7, numel=10_000))  # larger than the whole budget
    assert tier.delete("ka") and not tier.is_pinned("ka")  # explicit delete still works


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_priority_policy(kind: str, tmp_path: Path) -> None:
    tier = new_tier(kind, tmp_path, unit_budget(kind, tmp_path, 3.5), policy="priority")
    tier.put("k_hi", small(0), priority=5)
    tier.put("k_lo1", small(1), priority=0)
    tier.put("k_lo2", small(2), priority=0)
    assert tier.priority_of("k_hi") == 5
    tier.get("k_lo1")
    tier.get("k_lo2")
    res = tier.put("k_new", small(3), priority=1)  # k_hi is least recent but outranks the rest
    assert [e.key for e in res.evicted] == ["k_lo1"]
    assert [e.key for e in tier.put("k_new2", small(4), priority=1).evicted] == ["k_lo2"]
    assert [e.key for e in tier.put("k_new3", small(5), priority=1).evicted] == ["k_new"]
    assert "k_hi" in tier.keys()


def test_custom_policy_is_one_registered_class() -> None:
    class LargestFirst(EvictionPolicy):
        name = "test-largest-first"

        def order(self, candidates):
            return [s.key for s in sorted(candidates, key=lambda s: (-s.nbytes, s.key))]

    try:
        tier = make_tier("memory", device="cpu", budget_bytes=900, policy="test-largest-first")
        tier.put("big", small(0, numel=100))
        tier.put("s1", small(1, numel=50))
        tier.put("s2", small(2, numel=50))
        assert [e.key for e in tier.put("s3", small(3, numel=50)).evicted] == ["big"]
        with pytest.raises(ValueError):
            MemoryTier("cpu", 10, policy="no-such-policy")
        with pytest.raises(ValueError):
            make_tier("no-such-tier")
    finally:
        del POLICIES["test-largest-first"]


# ----------------------------------------------------------------------------- tiered store


def three_tiers(tmp_path: Path, dev: float = 2.5, host: float = 3.5, disk: int | None = None, **kw) -> TieredStore:
    return TieredStore(
        [
            MemoryTier("cpu", int(100 * dev), name="device"),
            HostTier(int(100 * host)),
            DiskTier(tmp_path / "disk", disk),
        ],
        **kw,
    )


def test_put_spills_down_and_get_promotes(tmp_path: Path) -> None:
    store = three_tiers(tmp_path)
    for i in range(6):
        store.put(f"k{i}", small(i))
    # device holds the 2 newest, host the next 3, the oldest spilled all the way to disk
    assert store.where("k5") == ["device"] and store.where("k4") == ["device"]
    assert [store.where(f"k{i}") for i in (1, 2, 3)] == [["host"]] * 3
    assert store.where("k0") == ["disk"]
    t = store.last_traffic
    assert t.written == {"device": 100, "host": 100, "disk": 100} and not t.dropped
    assert t.evicted == {"device": 100, "host": 100}

    got = store.get("k0")
    assert got is not None and same(got, small(0))
    t = store.last_traffic
    assert t.served_from == "disk" and t.read == {"disk": 100} and t.hits == {"disk": 1}
    # copied into both upper tiers (disk keeps its copy); every victim spilled one tier down:
    # host evicted k1 -> disk, device evicted k4 -> host, which evicted k2 -> disk
    assert store.where("k0") == ["device", "host", "disk"]
    assert store.where("k4") == ["host"] and store.where("k1") == store.where("k2") == ["disk"]
    assert t.written == {"host": 200, "device": 100, "disk": 200}
    assert t.evicted == {"host": 200, "device": 100}
    assert t.moved_bytes == 100 + 500 and not t.dropped
    # nothing was lost: every key is somewhere, intact
    for i in range(6):
        e = store.get(f"k{i}", promote=False)
        assert e is not None and same(e, small(i))
    assert store.get("absent") is None and store.last_traffic.misses == 1
    assert store.last_traffic.served_from is None


def test_promotion_returns_fastest_copy_and_respects_pins(tmp_path: Path) -> None:
    meta_store = TieredStore([MemoryTier("meta", 250, name="device"), HostTier(1000)])
    meta_store.tier("host").put("a", small(0))
    got = meta_store.get("a")
    assert got is not None and got.tensors["x"].device.type == "meta"  # the promoted copy
    assert meta_store.where("a") == ["device", "host"]
    store = TieredStore([MemoryTier("cpu", 250, name="device"), HostTier(1000)])
    store.tier("host").put("a", small(0))
    got = store.get("a")
    device_copy = store.tier("device").get("a")
    assert got is not None and device_copy is not None and got.tensors["x"] is device_copy.tensors["x"]
    store.pin("a")
    store.put("b", small(1))
    store.put("c", small(2))  # device is full: b (not pinned a) goes down
    assert store.where("a") == ["device", "host"] and store.where("b") == ["host"]
    assert store.is_pinned("a") and store.unpin("a") and not store.is_pinned("a")
    assert not store.pin("absent")


def test_demote_moves_one_tier_down_and_never_drops(tmp_path: Path) -> None:
    store = three_tiers(tmp_path)
    for i in range(2):
        store.put(f"k{i}", small(i))
    before = store.nbytes()
    assert store.demote("k0")
    t = store.last_traffic
    assert store.where("k0") == ["host"]
    assert t.read == {"device": 100} and t.written == {"host": 100} and t.evicted == {"device": 100}
    assert t.hits == {} and t.served_from is None
    after = store.nbytes()
    for name in ("device", "host"):  # traffic explains the byte changes
        assert after[name] - before[name] == t.written.get(name, 0) - t.evicted.get(name, 0)
    assert store.demote("k0") and store.where("k0") == ["disk"]
    assert not store.demote("k0")  # already in the slowest tier
    assert not store.demote("absent")
    assert store.demote("k1", to="disk") and store.where("k1") == ["disk"]
    got = store.get("k1")  # promotes again, content intact
    assert got is not None and same(got, small(1)) and store.where("k1") == ["device", "host", "disk"]
    assert store.demote("k1") and store.where("k1") == ["host", "disk"]  # lower copy kept
    with pytest.raises(KeyError):
        store.demote("k1", to="nowhere")
    full = TieredStore([HostTier(1000), MemoryTier("cpu", 100, name="small")])
    full.put("big", small(0, numel=50))
    assert not full.demote("big") and full.where("big") == ["host"]  # nowhere to go: stays


def test_drop_only_when_no_lower_tier_can_take_it(tmp_path: Path) -> None:
    store = TieredStore([MemoryTier("cpu", 250, name="device"), HostTier(250)])
    for i in range(5):
        store.put(f"k{i}", small(i))
    assert store.total_traffic.dropped == ["k0"]
    assert sorted(store.keys()) == ["k1", "k2", "k3", "k4"]


def test_too_big_for_top_tier_lands_lower_and_write_through(tmp_path: Path) -> None:
    store = three_tiers(tmp_path, dev=1.5, host=3.5, disk=None)
    store.put("big", small(0, numel=50))  # 200 B > device budget of 150 B
    assert store.where("big") == ["host"]
    with pytest.raises(StoreCapacityError):
        TieredStore([MemoryTier("cpu", 10), HostTier(10, name="h")]).put("k", small(1))
    store.put("wt", small(1), write_through=True)
    assert store.where("wt") == ["device", "disk"]
    wt_store = three_tiers(tmp_path / "b", write_through=True)
    wt_store.put("x", small(2))
    assert wt_store.where("x") == ["device", "disk"]
    assert wt_store.last_traffic.written == {"device": 100, "disk": 100}


def test_traffic_record_accumulates_and_merges(tmp_path: Path) -> None:
    store = three_tiers(tmp_path)
    receipt = TierTraffic()
    store.put("a", small(0), traffic=receipt)
    store.get("a", traffic=receipt)
    store.get("zz", traffic=receipt)
    assert receipt.written == {"device": 100} and receipt.read == {"device": 100}
    assert receipt.hits == {"device": 1} and receipt.misses == 1
    assert receipt.as_dict()["moved_bytes"] == 200
    total = TierTraffic()
    total += receipt
    total += receipt
    assert total.written == {"device": 200} and total.misses == 2
    assert store.total_traffic.written == {"device": 100}


def test_budgets_never_exceeded_random_ops(tmp_path: Path) -> None:
    rng = random.Random(1234)
    store = TieredStore(
        [
            MemoryTier("cpu", 1000, name="device"),
            HostTier(2500, policy="priority"),
            DiskTier(tmp_path / "disk", None),
        ]
    )
    budgets = store.budget_bytes()
    truth: dict[str, StoreEntry] = {}
    for step in range(300):
        op = rng.random()
        if op < 0.45 or not truth:
            key = f"k{rng.randrange(60):03d}"
            if key in truth:
                continue
            e = small(step, numel=rng.choice([10, 25, 60, 100]))
            truth[key] = e
            before = store.nbytes()
            store.put(key, e, priority=rng.randrange(3), pinned=rng.random() < 0.05)
        elif op < 0.9:
            key = rng.choice(sorted(truth))
            before = store.nbytes()
            got = store.get(key)
            assert got is not None and same(got, truth[key]), key
        else:
            key = rng.choice(sorted(truth))
            store.unpin(key)
            store.delete(key)
            del truth[key]
            assert store.get(key) is None
            continue
        t = store.last_traffic
        after = store.nbytes()
        for name in ("device", "host"):
            assert after[name] <= budgets[name], (step, name)
            # traffic accounts exactly for the in-memory tiers' byte changes
            assert after[name] - before[name] == t.written.get(name, 0) - t.evicted.get(name, 0), (step, name)
        assert not t.dropped
    assert store.keys() == set(truth)  # spill-down lost nothing (disk is unbounded)
    for key, e in truth.items():
        got = store.get(key, promote=False)
        assert got is not None and same(got, e)


# ----------------------------------------------------------------------------- guards


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_wrong_fingerprint_or_layout_is_refused(kind: str, tmp_path: Path) -> None:
    tier = new_tier(kind, tmp_path, None)
    tier.put("k", small(1))
    assert tier.get("k", expect_fingerprint="fp-A", expect_layout="L1") is not None
    with pytest.raises(FingerprintMismatchError, match="fp-B"):
        tier.get("k", expect_fingerprint="fp-B")
    with pytest.raises(FingerprintMismatchError, match="layout"):
        tier.get("k", expect_fingerprint="fp-A", expect_layout="L2")
    tier.put("nofp", StoreEntry({"x": torch.zeros(2)}, {"content_digest": "z"}))
    with pytest.raises(FingerprintMismatchError):
        tier.get("nofp", expect_fingerprint="fp-A")
    with pytest.raises(CollisionError):
        tier.get("k", expect_digest="d9999")
    assert tier.get("k", expect_digest="d0001") is not None


def test_tiered_fingerprint_refused_from_any_tier(tmp_path: Path) -> None:
    store = three_tiers(tmp_path)
    store.tier("disk").put("k", small(1, fingerprint="fp-B"))
    with pytest.raises(FingerprintMismatchError):
        store.get("k", expect_fingerprint="fp-A")
    assert store.where("k") == ["disk"]  # refused entries are not promoted


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_collision_guard(kind: str, tmp_path: Path) -> None:
    tier = new_tier(kind, tmp_path, None)
    tier.put("k", small(1))
    other = small(2)  # different content_digest under the same key
    with pytest.raises(CollisionError, match="content_digest"):
        tier.put("k", other)
    got = tier.get("k")
    assert got is not None and same(got, small(1))
    assert not tier.put("k", small(1)).stored  # same digest: deduplicated
    assert tier.put("k", other, overwrite=True).stored
    got = tier.get("k")
    assert got is not None and same(got, other)
    # a digest on one side only is a collision too
    with pytest.raises(CollisionError):
        tier.put("k", StoreEntry({"x": torch.zeros(1)}, {}))


def test_tiered_collision_checks_every_tier(tmp_path: Path) -> None:
    store = three_tiers(tmp_path)
    store.tier("disk").put("k", small(1))
    with pytest.raises(CollisionError):
        store.put("k", small(2))
    assert store.where("k") == ["disk"]
    store.put("k", small(2), overwrite=True)
    assert store.where("k") == ["device"]  # the stale disk copy was removed
    got = store.get("k", expect_digest="d0002")
    assert got is not None and same(got, small(2))
    with pytest.raises(CollisionError):
        store.get("k", expect_digest="d0001")
    # entries without digests: a put replaces every copy
    plain = lambda v: StoreEntry({"x": torch.full((3,), float(v))}, {})  # noqa: E731
    store.tier("host").put("p", plain(1))
    store.put("p", plain(2))
    assert store.where("p") == ["device"]


# ----------------------------------------------------------------------------- disk safety


def _stored(tmp_path: Path) -> tuple[DiskTier, Path, bytes]:
    tier = DiskTier(tmp_path / "d", None)
    tier.put("k", small(3))
    path = tier.file_for("k")
    return tier, path, path.read_bytes()


def test_every_flipped_byte_is_detected(tmp_path: Path) -> None:
    tier, path, good = _stored(tmp_path)
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 0xFF
        path.write_bytes(bytes(bad))
        with pytest.raises(CorruptEntryError):
            tier.get("k")
        assert not tier.verify("k")
    # one named case each: data section and header metadata
    bad = bytearray(good)
    bad[-3] ^= 0x01
    path.write_bytes(bytes(bad))
    with pytest.raises(CorruptEntryError, match="data checksum"):
        tier.get("k")


def test_metadata_edit_is_detected(tmp_path: Path) -> None:
    tier, path, good = _stored(tmp_path)
    assert b'"fp-A"' in good
    path.write_bytes(good.replace(b'"fp-A"', b'"fp-B"'))  # still valid JSON and safetensors
    with pytest.raises(CorruptEntryError, match="header checksum"):
        tier.get("k")
    with pytest.raises(CorruptEntryError):
        tier.peek("k")


def test_truncated_file_is_detected_at_every_length(tmp_path: Path) -> None:
    tier, path, good = _stored(tmp_path)
    for n in range(len(good)):
        path.write_bytes(good[:n])
        with pytest.raises(CorruptEntryError):
            tier.get("k")
    path.write_bytes(good + b"\0")
    with pytest.raises(CorruptEntryError):
        tier.get("k")
    path.write_bytes(good)
    got = tier.get("k")
    assert got is not None and same(got, small(3))


def test_foreign_and_misplaced_files_are_corrupt(tmp_path: Path) -> None:
    tier, path, good = _stored(tmp_path)
    safetensors.torch.save_file({"x": torch.zeros(3)}, str(path), metadata={"fingerprint": "fp-A"})
    with pytest.raises(CorruptEntryError, match="not a contextdeque"):
        tier.get("k")
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(CorruptEntryError):
        tier.get("k")
    tier.file_for("other").write_bytes(good)  # a valid file under another key's name
    with pytest.raises(CorruptEntryError, match="holds key"):
        tier.get("other")
    assert "other" not in tier.keys()


def test_corrupt_ok_treats_corrupt_as_absent(tmp_path: Path) -> None:
    tier, path, good = _stored(tmp_path)
    path.write_bytes(good[:-10])
    assert tier.get("k", corrupt_ok=True) is None
    assert not path.exists()  # the bad copy is discarded
    assert tier.get("k") is None
    tier.put("k", small(3))
    path.write_bytes(good[:20])
    tier.put("k", small(3))  # a put over a corrupt file replaces it (no false collision)
    got = tier.get("k")
    assert got is not None and same(got, small(3))
    # in a tiered store, a corrupt slow copy falls through to "absent" only when asked
    store = TieredStore([HostTier(1000), tier])
    path.write_bytes(good[:-1])
    with pytest.raises(CorruptEntryError):
        store.get("k")
    assert store.get("k", corrupt_ok=True) is None and store.last_traffic.misses == 1


def test_scrub_and_corrupt_files_are_evicted_first(tmp_path: Path) -> None:
    size = disk_file_size(tmp_path, small(0), key="k000")
    tier = DiskTier(tmp_path / "d", int(size * 3.5))
    for i in range(3):
        tier.put(f"k{i:03d}", small(i))
    tier.file_for("k002").write_bytes(b"\xff" * size)  # the newest file, but garbage
    res = tier.put("k003", small(3))
    assert res.evicted == () and not tier.file_for("k002").exists()  # garbage went first
    good = tier.file_for("k001").read_bytes()
    tier.file_for("k001").write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # header intact, data not
    assert tier.scrub() == [key_digest("k001") + ".safetensors"]
    assert sorted(tier.keys()) == ["k000", "k003"]
    assert tier.nbytes() == 2 * size


def test_accounting_is_recomputed_from_the_directory(tmp_path: Path) -> None:
    size = disk_file_size(tmp_path, small(0), key="k000")
    a = DiskTier(tmp_path / "d", int(size * 3.5))
    b = DiskTier(tmp_path / "d", int(size * 3.5))
    for i in range(3):
        a.put(f"k{i:03d}", small(i))
    assert b.nbytes() == 3 * size and sorted(b.keys()) == ["k000", "k001", "k002"]
    a.file_for("k001").unlink()  # removed behind both instances' backs
    assert a.nbytes() == b.nbytes() == 2 * size
    b.put("k003", small(3))
    b.put("k004", small(4))  # b's eviction sees a's files and a's recency
    assert sorted(a.keys()) == ["k002", "k003", "k004"]
    assert a.nbytes() <= a.budget_bytes


def test_disk_pins_follow_live_processes(tmp_path: Path) -> None:
    size = disk_file_size(tmp_path, small(0), key="k000")
    tier = DiskTier(tmp_path / "d", int(size * 2.5))
    tier.put("k000", small(0))
    tier.put("k001", small(1))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stem0, stem1 = key_digest("k000"), key_digest("k001")
    (tier.path / f"{stem0}.{dead.pid}.pin").touch()  # a pin left by a crashed process
    (tier.path / f"{stem1}.{os.getppid()}.pin").touch()  # a pin held by a live process
    assert not tier.is_pinned("k000") and tier.is_pinned("k001")
    assert [e.key for e in tier.put("k002", small(2)).evicted] == ["k000"]
    assert tier.pin("k002")
    with pytest.raises(StoreCapacityError):
        tier.put("k003", small(3))  # the rest is pinned (one live pin each)
    assert not (tier.path / f"{stem0}.{dead.pid}.pin").exists()  # stale marker cleaned


def test_permission_path_under_a_regular_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("not a directory")
    with pytest.raises(StorePermissionError, match="cannot create store directory"):
        DiskTier(f / "sub", None)
    with pytest.raises(StorePermissionError, match="not a directory"):
        DiskTier(f, None)


def test_permission_read_only_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        if os.geteuid() == 0:
            # root ignores mode bits; make os.access answer what the mode says for this path
            # (DiskTier's own check still runs and raises).
            real_access = os.access

            def access(path, mode, *a, **kw):  # type: ignore[no-untyped-def]
                if Path(path) == d and mode & os.W_OK:
                    return False
                return real_access(path, mode, *a, **kw)

            monkeypatch.setattr(os, "access", access)
        with pytest.raises(StorePermissionError, match="not readable and writable") as ei:
            DiskTier(d, None)
        assert "0o500" in str(ei.value) and isinstance(ei.value, PermissionError)
    finally:
        d.chmod(0o700)


def test_permission_lost_after_construction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path / "d", None)
    real_open = os.open

    def deny(path, flags, *a, **kw):  # type: ignore[no-untyped-def]
        if flags & os.O_CREAT and Path(path).name.startswith(".tmp-"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", deny)
    with pytest.raises(StorePermissionError, match="cannot write"):
        tier.put("k", small(1))
    monkeypatch.undo()
    assert tier.keys() == [] and list(tier.path.glob(".tmp-*")) == []


# ----------------------------------------------------------------------------- processes

# A long-lived helper process imports torch once and forks writers on demand, so that
# dozens of SIGKILLed writers cost milliseconds each instead of an interpreter start.
ZYGOTE = (
    textwrap.dedent(
        """
        import os, sys, traceback
        import torch
        torch.set_num_threads(1)
        from contextdeque.core.errors import CollisionError
        from contextdeque.stores import DiskTier, StoreEntry
        """
    )
    + inspect.getsource(make_entry)
    + textwrap.dedent(
        """
        def crash_writer(path, out, start, nkeys, nbytes):
            tier = DiskTier(path, None, stale_tmp_s=1e9)
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            i = start
            while True:
                key = f"k{i % nkeys:03d}"
                tier.put(key, make_entry(i, nbytes), overwrite=True)
                os.write(fd, f"{key} {i}\\n".encode())  # printed only after put returned
                i += 1

        def concurrent_writer(path, out, tag, n, nbytes, budget):
            budget = None if budget == "none" else int(budget)
            tier = DiskTier(path, budget)
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            base = 1000 if tag == "A" else 2000
            for i in range(n):
                tier.put(f"{tag}-{i:03d}", make_entry(base + i, nbytes))
                tier.put(f"shared-{i % 5}", make_entry(i % 5, nbytes))  # same content in both
                if i == n // 2:
                    try:  # same key, different content: exactly one writer may win
                        tier.put("clash", make_entry(base, nbytes))
                        os.write(fd, b"clash-won\\n")
                    except CollisionError:
                        os.write(fd, b"clash-refused\\n")
                if budget is not None and tier.nbytes() > budget:
                    os.write(fd, b"OVER-BUDGET\\n")
            os.write(fd, b"done\\n")

        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "fork":
                pid = os.fork()
                if pid == 0:
                    code = 0
                    try:
                        argv = [int(a) if a.isdigit() else a for a in args[1:]]
                        globals()[args[0]](*argv)
                    except BaseException:
                        traceback.print_exc()
                        code = 1
                    os._exit(code)
                print(pid, flush=True)
            elif cmd == "reap":
                _, status = os.waitpid(int(args[0]), 0)
                print(status, flush=True)
        """
    )
)


class Zygote:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def _ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply, f"zygote died (rc={self.proc.poll()})"
        return reply.strip()

    def fork(self, *args: object) -> int:
        return int(self._ask("fork " + " ".join(str(a) for a in args)))

    def reap(self, pid: int) -> int:
        """Wait for a child; returns its raw wait status."""
        return int(self._ask(f"reap {pid}"))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def _confirmed(out: Path) -> dict[str, int]:
    """key -> highest version whose put returned (complete lines only)."""
    best: dict[str, int] = {}
    if not out.exists():
        return best
    for line in out.read_text().splitlines(keepends=True):
        if not line.endswith("\n"):
            continue  # killed mid-print: not a confirmation
        key, v = line.split()
        best[key] = max(best.get(key, -1), int(v))
    return best


def _check_read(tier: DiskTier, key: str, nbytes: int, full: bool = True) -> StoreEntry | None:
    """A read is either absent or the complete entry some version wrote; never corrupt.

    ``full`` regenerates the version's content and compares it; otherwise the store's own
    verification (checksums) plus the metadata must agree (cheap, while a writer runs).
    """
    got = tier.get(key)  # CorruptEntryError here fails the test
    if got is not None:
        version = int(got.meta["version"])
        if full:
            assert same(got, make_entry(version, nbytes)), key
        else:
            payload = 4 * max(nbytes // 4 - 64, 1) + 4 * 16 * 2  # x (int32) + y (bf16), see make_entry
            assert got.content_digest == f"digest-{version:08d}" and got.nbytes == payload, key
    return got


def test_sigkill_mid_write_never_leaves_corrupt_entries(tmp_path: Path, zygote: Zygote) -> None:
    nkeys, nbytes, kills = 12, 3 * 1024 * 1024, 60
    path, out = tmp_path / "store", tmp_path / "confirmed.txt"
    reader = DiskTier(path, None, stale_tmp_s=1e9)
    rng = random.Random(7)
    start = 0
    for _ in range(kills):
        pid = zygote.fork("crash_writer", path, out, start, nkeys, nbytes)
        deadline = time.monotonic() + rng.uniform(0.0, 0.25)
        while time.monotonic() < deadline:  # read concurrently with the writer
            _check_read(reader, f"k{rng.randrange(nkeys):03d}", nbytes, full=False)
            time.sleep(0.01)  # leave the writer CPU on a 2-core machine
        os.kill(pid, signal.SIGKILL)
        status = zygote.reap(pid)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        start += 1000  # versions of each writer are distinct
    confirmed = _confirmed(out)
    assert len(confirmed) > 0
    for key, version in confirmed.items():
        got = _check_read(reader, key, nbytes)
        assert got is not None, f"{key} was confirmed (v{version}) but is gone"
        assert int(got.meta["version"]) >= version  # a later complete version may replace it
    for i in range(nkeys):
        _check_read(reader, f"k{i:03d}", nbytes)
    assert reader.scrub() == []  # every committed file verifies
    temps = list(path.glob(".tmp-*"))
    assert temps, "no kill landed mid-write: the test did not exercise what it claims"
    assert reader.clean_temp(min_age_s=0) == len(temps)
    assert list(path.glob(".tmp-*")) == []
    files = list(path.glob("*.safetensors"))
    assert reader.nbytes() == sum(p.stat().st_size for p in files) and len(files) == len(reader.keys())


@pytest.mark.parametrize("budget_entries", [None, 8])
def test_two_processes_share_one_disk_store(tmp_path: Path, zygote: Zygote, budget_entries: int | None) -> None:
    nbytes, n = 512 * 1024, 40
    path = tmp_path / "store"
    size = disk_file_size(tmp_path, make_entry(1000, nbytes), key="A-000")
    budget = None if budget_entries is None else size * budget_entries
    outs = [tmp_path / "A.txt", tmp_path / "B.txt"]
    pids = [
        zygote.fork("concurrent_writer", path, outs[0], "A", n, nbytes, budget or "none"),
        zygote.fork("concurrent_writer", path, outs[1], "B", n, nbytes, budget or "none"),
    ]
    statuses = [zygote.reap(p) for p in pids]
    assert all(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in statuses), statuses
    logs = [o.read_text().split() for o in outs]
    assert all(log[-1] == "done" and "OVER-BUDGET" not in log for log in logs), logs
    tier = DiskTier(path, budget)
    assert tier.scrub() == []
    keys = tier.keys()
    for key in keys:
        got = tier.get(key)
        assert got is not None and same(got, make_entry(int(got.meta["version"]), nbytes))
    files = list(path.glob("*.safetensors"))
    assert tier.nbytes() == sum(p.stat().st_size for p in files) and len(files) == len(keys)
    assert list(path.glob(".tmp-*")) == [] and list(path.glob("*.pin")) == []
    clash = sorted(w for log in logs for w in log if w.startswith("clash"))
    if budget is None:
        expected = {f"{t}-{i:03d}" for t in "AB" for i in range(n)} | {f"shared-{i}" for i in range(5)} | {"clash"}
        assert set(keys) == expected
        assert clash == ["clash-refused", "clash-won"]
    else:
        assert tier.nbytes() <= budget
        assert len(clash) == 2


# ----------------------------------------------------------------------------- layering


def test_stores_import_only_allowed_modules() -> None:
    allowed_third_party = {"torch", "safetensors", "filelock", "valkey"}
    for py in sorted(STORES_DIR.glob("*.py")):
        tree = ast.parse(py.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{py.name}: use absolute imports"
                mods = [node.module or ""]
            else:
                continue
            for m in mods:
                top = m.split(".")[0]
                ok = (
                    top in sys.stdlib_module_names
                    or top in allowed_third_party
                    # core.capsule + core.chunk: the compressed-at-rest tier decodes entries into chunks (below stores)
                    or m in ("contextdeque.core.errors", "contextdeque.core.args", "contextdeque.core.kv",
                             "contextdeque.core.registry", "contextdeque.core.capsule", "contextdeque.core.chunk",
                             "contextdeque.core.counters")  # (TierTraffic is a Tally: one counts type)
                    or m.startswith("contextdeque.stores")
                )
                assert ok, f"{py.name} imports {m}"
