"""Overlapped tier loading (MPIC): ``ContextWindow.extend`` loads stored chunks in the background
while the model encodes misses and forms patches; it returns exactly what sequential loading (and a
loop of ``append``) returns, and a failed load falls back to recomputing with the fallback in the
receipt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import seeded_ids

from contextdeque import ContextWindow
from contextdeque.core.errors import CorruptEntryError, WindowError
from contextdeque.stores import DiskTier, HostTier, MemoryTier, Prefetcher, StoreEntry, TieredStore, fetch, settle
from contextdeque.window.store import WindowStore

pytestmark = pytest.mark.usefixtures("one_thread")

N = 6


@pytest.fixture(scope="module")
def ids():
    return [seeded_ids(30, 200 + i) for i in range(N)]


def _disk_with(be, ids, path, which):
    disk = DiskTier(path, None)
    for i in which:
        c = be.encode(token_ids=ids[i])
        tensors, meta = c.to_entry()
        disk.put(WindowStore.chunk_key(c), StoreEntry(tensors, meta))
    return disk


def _store(path, host=None):
    tiers = [MemoryTier("cpu", None, name="device")]
    if host is not None:
        tiers.append(host)
    tiers.append(DiskTier(path, None))
    return TieredStore(tiers)


def _pages(win):
    return [(s.chunk.id, s.page) for s in win._state.slots]


def _same_windows(a, b):
    pa, pb = _pages(a), _pages(b)
    return len(pa) == len(pb) and all(
        ia == ib and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(ga, gb))
        for (ia, ga), (ib, gb) in zip(pa, pb)
    )


def test_overlapped_returns_exactly_what_sequential_returns(be, ids, tmp_path):
    _disk_with(be, ids, tmp_path, range(0, N, 2))
    items = [{"token_ids": x} for x in ids]
    seq = ContextWindow(be, rank=8, store=_store(tmp_path), patch_policy="eager")
    r_seq = seq.extend(items, overlap=False)
    ovl = ContextWindow(be, rank=8, store=_store(tmp_path), patch_policy="eager")
    r_ovl = ovl.extend(items, overlap=True, workers=2)
    loop = ContextWindow(be, rank=8, store=_store(tmp_path), patch_policy="eager")
    for x in ids:
        loop.append(token_ids=x)
    assert _same_windows(seq, ovl) and _same_windows(seq, loop)
    for r in (r_seq, r_ovl):
        assert r.op == "extend" and len(r.refs) == N and not r.load_fallbacks
        assert r.encodes == N // 2 and r.patches_formed == N - 1
        assert r.loading["loads"] == N // 2 and r.loading["misses"] == N // 2 and r.loading["by_tier"] == {"disk": N // 2}
        assert r.bytes_moved["disk"] > 0
    assert r_ovl.loading["overlapped"] and not r_seq.loading["overlapped"]
    assert (r_seq.forwards, r_seq.tokens_prefilled) == (r_ovl.forwards, r_ovl.tokens_prefilled)
    # loaded canonicals were promoted into the fastest tier
    key = WindowStore.chunk_key(ovl._state.slots[0].chunk)
    assert ovl.store.tier_of(key) == "device"
    assert [r.chunk_id for r in r_ovl.refs] == [s.chunk.id for s in ovl._state.slots]


def test_host_and_disk_tiers_and_resident_chunks(be, ids, tmp_path):
    _disk_with(be, ids, tmp_path, [1, 4])
    host = HostTier(None, name="host")
    for i in (2,):
        c = be.encode(token_ids=ids[i])
        tensors, meta = c.to_entry()
        host.put(WindowStore.chunk_key(c), StoreEntry(tensors, meta))
    store = _store(tmp_path, host)
    pre = ContextWindow(be, rank=8, store=store)
    pre.append(token_ids=ids[0])  # resident in the device tier while this window holds it
    a = ContextWindow(be, rank=8, store=store).extend([{"token_ids": x} for x in ids], overlap=True)
    assert a.loading["by_tier"] == {"disk": 2, "host": 1} and a.loading["resident"] == 1 and a.loading["misses"] == 2


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_load_is_recomputed_with_the_fallback_in_the_receipt(be, ids, tmp_path, damage, overlap):
    disk = _disk_with(be, ids, tmp_path, range(0, N, 2))
    victim = be.encode(token_ids=ids[2])
    key = WindowStore.chunk_key(victim)
    f = disk.file_for(key)
    data = f.read_bytes()
    f.write_bytes(data[:-7] + bytes([data[-7] ^ 0xFF]) + data[-6:] if damage == "flip" else data[: len(data) // 2])
    with pytest.raises(CorruptEntryError):
        disk.get(key)
    win = ContextWindow(be, rank=8, store=_store(tmp_path), patch_policy="eager")
    r = win.extend([{"token_ids": x} for x in ids], overlap=overlap)
    assert len(r.load_fallbacks) == 1
    fb = r.load_fallbacks[0]
    assert fb.chunk_id == victim.id and fb.tier == "disk" and fb.error.startswith("CorruptEntryError")
    assert r.encodes == N // 2 + 1 and r.loading["fallbacks"] == 1
    assert any("failed" in n and "recomputed" in n for n in r.notes)
    assert r.as_dict()["load_fallbacks"][0]["chunk_id"] == victim.id
    clean = ContextWindow(be, rank=8, patch_policy="eager")
    for x in ids:
        clean.append(token_ids=x)
    assert _same_windows(win, clean)  # the recomputed chunk is the chunk
    assert DiskTier(tmp_path, None).get(key) is None  # the corrupt copy was replaced, not kept


def test_prefetcher(be, ids, tmp_path):
    _disk_with(be, ids, tmp_path, [0])
    store = _store(tmp_path)
    key = WindowStore.chunk_key(be.encode(token_ids=ids[0]))
    with Prefetcher(store, workers=2) as pf:
        got = pf.submit(key, expect_fingerprint=be.fingerprint).result()
        missing = pf.submit("nothing/here").result()
    assert got.ok and got.tier == "disk" and got.index == 1 and got.seconds >= 0.0
    assert missing.entry is None and missing.error is None and missing.tier is None
    assert store.where(key) == ["disk"]  # a background read neither promotes nor counts
    from contextdeque.stores import TierTraffic

    tr = TierTraffic()
    entry = settle(store, got, tr)
    assert entry is not None and store.where(key) == ["device", "disk"]
    assert tr.hits == {"disk": 1} and tr.written.get("device", 0) == entry.nbytes
    other = fetch(store, key, expect_fingerprint="another-model")
    assert not other.ok and type(other.error).__name__ == "FingerprintMismatchError"
    with pytest.raises(ValueError):
        Prefetcher(store, workers=0)
    with pytest.raises(TypeError):
        Prefetcher(DiskTier(tmp_path, None))  # type: ignore[arg-type]


def test_extend_refuses_bad_input_and_loses_nothing(be, ids, tmp_path):
    win = ContextWindow(be, rank=8)
    win.append(token_ids=ids[0])
    before = _pages(win)
    for bad in ("just text", [42], [{"tokens": [1, 2]}], [{"token_ids": ids[1], "text": "x"}]):
        with pytest.raises(WindowError):
            win.extend(bad)  # type: ignore[arg-type]
    with pytest.raises(WindowError):
        win.extend([{"token_ids": ids[1]}], workers=0)
    assert _pages(win) == before and len(win) == 1
    r = win.extend(["plain text is tokenized" if be.tokenizer else {"token_ids": ids[1]}, be.encode(token_ids=ids[2])])
    assert len(r.refs) == 2 and len(win) == 3 and r.loading["given"] == 1


def test_extend_respects_the_budget(be, ids):
    win = ContextWindow(be, rank=8, budget_tokens=70)
    r = win.extend([{"token_ids": x} for x in ids[:4]])
    assert len(win) == 2 and len(r.left) == 2 and all(ref in win for ref in r.refs)


def test_load_bench_cli_smoke(capsys):
    import json

    from contextdeque.cli import main

    rc = main(["load-bench", "--model", "tiny", "--chunks", "4", "--chunk-tokens", "64", "--runs", "1", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical"] is True and out["on_disk"] == 2 and out["missing"] == 2
    assert out["sequential"]["by_tier"] == {"disk": 2} == out["overlapped"]["by_tier"]
    assert out["sequential"]["encodes"] == out["overlapped"]["encodes"] == 2
    assert out["speedup"] > 0 and out["ideal_speedup"] >= 1.0


@pytest.mark.parametrize("rho", [1.0, 0.4])
def test_load_bench_with_chunks_compressed_at_rest(capsys, rho):
    import json

    from contextdeque.cli import main

    rc = main(["load-bench", "--model", "tiny", "--chunks", "4", "--chunk-tokens", "64", "--runs", "1", "--json",
               "--capsule", str(rho)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    cap = out["capsule"]
    assert out["identical"] is True and out["sequential"]["by_tier"] == {"disk": 2} and out["sequential"]["fallbacks"] == 0
    assert len(cap["recon_error_k"]) == 2 and cap["calibration_chunks"] == 16
    if rho == 1.0:  # the identity basis: nothing saved, nothing lost
        assert cap["recon_error_k"] == [0.0, 0.0] and cap["recon_error_v"] == [0.0, 0.0]
        assert cap["kv_bytes_saved_fraction"] < 0.0
    else:
        assert all(0.0 < e < 1.0 for e in cap["recon_error_k"] + cap["recon_error_v"])
        assert 0.4 < cap["kv_bytes_saved_fraction"] < 0.7 and 0.0 < cap["bytes_saved_fraction"] < cap["kv_bytes_saved_fraction"]
    with pytest.raises(SystemExit):
        main(["load-bench", "--capsule", "0"])


def test_replay_cost_model_learns_the_overlap():
    """An admission whose canonicals come from host/disk costs max(load, compute), not their sum,
    when loads overlap; everything else the replay counts is unchanged."""
    from contextdeque.replay import CostModel, ReplayConfig, Replayer
    from contextdeque.traces import generate

    t = generate("web", seed=3)
    slow_disk = CostModel(disk_bytes_per_s=2e7, host_bytes_per_s=5e7)  # loads comparable to compute
    dev = max(a.tokens for a in t.chunks.values()) * slow_disk.kv_bytes_per_token * 2
    runs = {}
    for ov in (False, True):
        cfg = ReplayConfig(device_bytes=dev, host_bytes=dev, overlap_loads=ov)
        runs[ov] = Replayer(t, "arrival", "lru", "patch", cost=slow_disk, config=cfg).run()
    seq, ovl = runs[False], runs[True]
    assert seq.load_seconds > 0 and seq.overlap_saved_seconds == 0.0
    assert ovl.load_seconds == pytest.approx(seq.load_seconds)
    assert 0 < ovl.overlap_saved_seconds <= ovl.load_seconds
    assert ovl.est_seconds == pytest.approx(seq.est_seconds - ovl.overlap_saved_seconds)
    a, b = seq.as_dict(), ovl.as_dict()
    for k in ("est_seconds", "overlap_saved_seconds"):
        a.pop(k), b.pop(k)
    assert a == b
