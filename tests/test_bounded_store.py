"""Bounded memory by default: the default store keeps a memory budget and spills to a disk tier
in the per-user cache directory; an evicted chunk is recalled from disk, or, when the disk budget
dropped it too, re-encoded from its source with the repair in the receipt."""

from __future__ import annotations

import pytest
import torch
from helpers import micro_llama, seeded_ids

from contextdeque.core.errors import StoreConfigError
from contextdeque.model.hf import HFBackend
from contextdeque.stores import DiskTier, HostTier, MemoryTier, TieredStore
from contextdeque.window import ContextWindow
from contextdeque.window.store import MEMORY_BUDGET_ENV, STORE_DIR_ENV, default_store, parse_bytes


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    return HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-bounded-llama")


def layers(cache):
    from contextdeque.core import compat

    return [compat.cache_layer(cache, i) for i in range(compat.cache_num_layers(cache))]


def same_cache(a, b) -> bool:
    return all(torch.equal(x, y) for (ka, va), (kb, vb) in zip(layers(a), layers(b)) for x, y in ((ka, kb), (va, vb)))


def test_parse_bytes_and_refusals():
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("2GB") == 2 * 10**9 and parse_bytes(" 7 ") == 7
    assert parse_bytes("10%", 1000) == 100 and parse_bytes(4096) == 4096
    for bad in ("lots", "-1", "5 parsecs", True):
        with pytest.raises(StoreConfigError):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="percentage"):
        parse_bytes("10%")


def test_default_store_is_bounded_and_spills_to_a_per_user_disk_tier(tmp_path, monkeypatch):
    monkeypatch.setenv(STORE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(MEMORY_BUDGET_ENV, "64MiB")
    store = default_store("cpu")
    assert [t.name for t in store.tiers] == ["device", "host", "disk"]
    assert isinstance(store.tiers[0], MemoryTier) and isinstance(store.tiers[1], HostTier)
    assert isinstance(store.tiers[2], DiskTier) and store.tiers[2].path == tmp_path / "cache"
    b = store.budget_bytes()
    assert b["device"] + b["host"] == 64 << 20 and b["disk"] is not None and b["disk"] > 0
    monkeypatch.setenv(MEMORY_BUDGET_ENV, "a lot")
    with pytest.raises(StoreConfigError, match=MEMORY_BUDGET_ENV):
        default_store("cpu")
    monkeypatch.delenv(MEMORY_BUDGET_ENV)
    assert sum(v for k, v in default_store("cpu").budget_bytes().items() if k != "disk") > 0
    assert [t.name for t in default_store("cpu", disk=False).tiers] == ["device", "host"]


def test_memory_stays_within_budget_and_evicted_chunks_come_back_from_disk(backend, tmp_path):
    budget = 48 * 1024
    store = default_store("cpu", memory_budget=budget, disk_dir=tmp_path / "d", disk_budget="1GiB")
    win = ContextWindow(backend, budget_tokens=24, rank=2, store=store, patch_policy="eager")
    refs = []
    for i in range(30):
        refs.append(win.append(token_ids=seeded_ids(4 + i % 5, 100 + i, vocab=60).tolist()))
        used = store.nbytes()
        assert used["device"] + used["host"] <= budget
    assert store.nbytes()["disk"] > 0, "what memory could not keep went to disk"
    gone = [r for r in win.evicted_refs]
    assert len(gone) > 10
    receipt = win.recall(gone[0])
    assert receipt.encodes == 0 and receipt.traffic.read.get("disk", 0) > 0, receipt.summary()


def test_a_dropped_canonical_is_re_encoded_from_its_source(backend, tmp_path):
    win = ContextWindow(backend, rank=2, store=TieredStore([MemoryTier("cpu", None)]))
    twin = ContextWindow(backend, rank=2, store=TieredStore([MemoryTier("cpu", None)]))
    for w in (win, twin):
        a = w.append(token_ids=[5, 6, 7, 8])
        w.append(token_ids=[9, 10, 11])
        w.evict(a)
    key = win._state.evicted[win.evicted_refs[0]].chunk_key
    assert win.store.store.delete(key), "as a budget would drop it"
    receipt = win.recall(win.evicted_refs[0], at="end")
    assert receipt.encodes == 1 and any("re-encoded" in n and "from its source" in n for n in receipt.repairs), receipt.repairs
    twin.recall(twin.evicted_refs[0], at="end")
    assert same_cache(win.materialize(), twin.materialize()), "the re-encoded canonical is the one it had"

    # a session saved while the canonical is gone keeps the source: the reopened window re-encodes
    win.evict(win.refs[-1])
    win.store.store.delete(win._state.evicted[win.evicted_refs[0]].chunk_key)
    win.save(tmp_path / "s.cdq")
    opened = ContextWindow.open(tmp_path / "s.cdq", backend, store=TieredStore([MemoryTier("cpu", None)]))
    r = opened.recall(opened.evicted_refs[0])
    assert r.encodes == 1 and any("re-encoded" in n for n in r.repairs)
