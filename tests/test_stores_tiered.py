"""The tier stack (``TieredStore``): spill on eviction, promotion on use, demotion, write-through,
traffic records, budgets under random operations."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from contextdeque.core.errors import StoreCapacityError
from contextdeque.stores import (
    DiskTier,
    HostTier,
    MemoryTier,
    StoreEntry,
    TieredStore,
    TierTraffic,
)
from store_helpers import (
    same,
    small,
    three_tiers,
)


# ----------------------------------------------------------------------------- tiered store


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


def test_journal_records_each_operation_that_moved_bytes(tmp_path: Path) -> None:
    """``journal``: each operation that moved bytes, in order, with its key and its own traffic
    (what ``scripts/replay_vs_window.py --diverge`` compares); none by default."""
    store = three_tiers(tmp_path)
    store.put("a", small(0))
    assert store.journal is None
    store.journal = []
    for i in range(1, 4):
        store.put(f"k{i}", small(i))  # the device holds two: k2 spills "a" into the host, k3 spills k1
    store.get("zz")  # a miss moves nothing: not journalled
    store.get("a")  # served from the host and copied up, spilling k2
    store.demote("k3")  # the host is full: its oldest spills to disk
    assert [(op, key) for op, key, _ in store.journal] == [("put", "k1"), ("put", "k2"), ("put", "k3"), ("get", "a"),
                                                            ("demote", "k3")]
    first, _, spill, hit, demotion = (tr for _, _, tr in store.journal)
    assert first.written == {"device": 100} and not first.evicted
    assert spill.written == {"device": 100, "host": 100} and spill.evicted == {"device": 100}
    assert hit.read == {"host": 100} and hit.written == {"device": 100, "host": 100} and hit.evicted == {"device": 100}
    assert demotion.read == {"device": 100} and demotion.written == {"host": 100, "disk": 100}
    assert demotion.evicted == {"device": 100, "host": 100}
    total = TierTraffic()
    for _, _, tr in store.journal:
        total += tr
    total.add_written("device", 100)  # ("a", put before the journal began)
    assert (total.read, total.written, total.evicted) == (store.total_traffic.read, store.total_traffic.written,
                                                          store.total_traffic.evicted)


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
