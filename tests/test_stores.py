"""Tests of contextdeque.stores: keys, entries, round trips per tier, eviction, the fingerprint and
collision guards, and what the stores may import."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from contextdeque.core.errors import (
    CollisionError,
    FingerprintMismatchError,
    InvalidEntryError,
    StoreCapacityError,
)
from contextdeque.stores import (
    POLICIES,
    DiskTier,
    EvictionPolicy,
    HostTier,
    MemoryTier,
    StoreEntry,
    StoreKey,
    chunk_key,
    embeds_key,
    make_tier,
)
from contextdeque.stores.disk import key_digest
from store_helpers import (
    STORES_DIR,
    TIER_KINDS,
    new_tier,
    same,
    small,
    three_tiers,
    unit_budget,
)


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
