"""Cross-process pins: a window's holds are leases every process sharing a disk store respects.

Two processes run random window operations on one budgeted ``DiskTier`` directory (the only
tier, so every held canonical and patch lives there and the other process's budget is what
could evict it): after every operation each checks that every entry it holds is still stored.
(An entry the window holds but that never got stored, e.g. a patch the full disk refused, is
not an eviction and is not counted.) A SIGKILLed holder's leases are reclaimed (also while it is an unreaped zombie); a recycled pid
does not keep a dead holder's lease; another host's leases follow a TTL its holder renews.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from contextdeque.stores import DiskTier, StoreEntry
from contextdeque.stores.disk import PIN_SUFFIX, holder_alive, host_id, key_digest

TESTS = str(Path(__file__).parent)

_WORKER = textwrap.dedent(
    """
    import json, random, sys, time
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)
    from helpers import micro_llama, seeded_ids
    from contextdeque.core.errors import ContextDequeError
    from contextdeque.model.hf import HFBackend
    from contextdeque.stores import DiskTier, TieredStore
    from contextdeque.window import ContextWindow

    backend = HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-lease-llama")
    tier = DiskTier({path!r}, {budget}, fsync=False)
    store = TieredStore([tier])
    win = ContextWindow(backend, budget_tokens=24, rank=2, store=store, patch_policy="eager")
    rng = random.Random({seed})
    pool = [seeded_ids(3 + i % 6, 1000 + i, vocab=60).tolist() for i in range(40)]
    ops = errors = violations = unstored = 0
    present = set()
    kinds = {{}}
    t_end = time.monotonic() + {max_s}
    while ops < {n_ops} and time.monotonic() < t_end:
        op = rng.choice(["append", "append", "append", "slide", "evict", "recall", "reorder", "purge"])
        try:
            if op == "append":
                win.append(token_ids=rng.choice(pool))
            elif op == "slide" and len(win):
                win.slide(1)
            elif op == "evict" and len(win):
                win.evict(rng.choice(win.refs))
            elif op == "recall" and win.evicted_refs:
                win.recall(rng.choice(win.evicted_refs), at=rng.randint(0, len(win)))
            elif op == "reorder" and len(win) > 1:
                order = list(win.refs); rng.shuffle(order); win.reorder(order)
            elif op == "purge" and win.evicted_refs:
                win.purge(rng.choice(win.evicted_refs))
            else:
                continue
        except ContextDequeError as e:
            errors += 1
            kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
        ops += 1
        held = {{k for k, n in win.store._holds.items() if n > 0}}
        # an eviction of a held entry: held and stored at the last check, still held, gone now
        violations += sum(1 for k in held & present if not tier.contains(k))
        present = {{k for k in held if tier.contains(k)}}
        unstored = max(unstored, len(held - present))
    ev = store.total_traffic
    print(json.dumps({{"ops": ops, "errors": errors, "kinds": kinds, "violations": violations,
                      "evicted": sum(ev.evicted.values()), "dropped": len(ev.dropped), "unstored": unstored,
                      "holds": len([k for k, n in win.store._holds.items() if n > 0])}}), flush=True)
    """
)


def _run_workers(path: Path, budget: int, n_ops: int, seeds: tuple[int, ...]) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER.format(tests=TESTS, path=str(path), budget=budget, seed=s, n_ops=n_ops, max_s=1e9)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for s in seeds
    ]
    out = []
    for p in procs:
        so, se = p.communicate(timeout=1200)
        assert p.returncode == 0, se[-3000:]
        out.append(json.loads(so.strip().splitlines()[-1]))
    return out


def test_two_processes_never_evict_each_others_held_entries(tmp_path):
    """>= 500 random operations in each of two processes sharing one disk store whose budget is
    under pressure (entries are evicted all along): no entry a live window holds is ever evicted."""
    path = tmp_path / "shared"
    results = _run_workers(path, budget=96 * 1024, n_ops=500, seeds=(1, 2))
    for r in results:
        assert r["ops"] >= 500
        assert r["violations"] == 0, r
        assert r["errors"] == 0, r
    assert sum(r["evicted"] for r in results) > 0, "the budget must be under pressure for this to mean anything"
    tier = DiskTier(path, 96 * 1024)
    assert tier.nbytes() <= 96 * 1024
    assert tier.live_leases() == {}, "both processes exited: every lease is reclaimed"


_HOLDER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)
    from helpers import micro_llama
    from contextdeque.model.hf import HFBackend
    from contextdeque.stores import DiskTier, TieredStore
    from contextdeque.window import ContextWindow
    backend = HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-lease-llama")
    win = ContextWindow(backend, rank=2, store=TieredStore([DiskTier({path!r}, None, fsync=False)]))
    for ids in ([5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15]):
        win.append(token_ids=ids)
    print(" ".join(k for k in win.store._holds), flush=True)
    time.sleep(600)
    """
)


def test_sigkilled_holders_leases_are_reclaimed(tmp_path):
    path = tmp_path / "shared"
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER.format(tests=TESTS, path=str(path))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        held = proc.stdout.readline().split()
        assert held, proc.stderr.read()
        tier = DiskTier(path, None)
        assert all(tier.is_pinned(k) for k in held), "a live holder's leases hold in another process"
        holders = {h for hs in tier.live_leases().values() for h in hs}
        assert len(holders) == 1 and next(iter(holders)).startswith(f"{proc.pid}-")
        proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 60
        while Path(f"/proc/{proc.pid}").exists() and open(f"/proc/{proc.pid}/stat").read().split(") ")[1][0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # killed but not reaped yet (a zombie): already dead to the store
        assert not any(tier.is_pinned(k) for k in held)
    finally:
        proc.kill()
        proc.wait()
    assert tier.live_leases() == {} and list(path.glob(f"*{PIN_SUFFIX}")) == []
    # and its entries are evictable again: a budget that fits one more entry evicts them
    size = sum(tier.file_for(k).stat().st_size for k in held)
    small = DiskTier(path, size, fsync=False)
    small.put("newcomer", StoreEntry({"x": torch.zeros(max(1, size // 8), dtype=torch.float32)}))
    assert not all(small.contains(k) for k in held)


def test_lease_liveness_rules(tmp_path):
    tier = DiskTier(tmp_path / "d", None, fsync=False)
    tier.put("k", StoreEntry({"x": torch.ones(4)}))
    stem = key_digest("k")
    me = os.getpid()
    # this process, but a lease recorded with another start time: a recycled pid, dead
    (tier.path / f"{stem}.{me}-1-{host_id()}-deadbeef{PIN_SUFFIX}").touch()
    assert not tier.is_pinned("k")
    assert list(tier.path.glob(f"*{PIN_SUFFIX}")) == [], "the dead lease is removed"
    # another host: held while renewed within the TTL; forever without one
    marker = tier.path / f"{stem}.4242-99-0123456789ab-cafe0000{PIN_SUFFIX}"
    marker.touch()
    old = time.time() - 120
    os.utime(marker, (old, old))
    assert tier.is_pinned("k"), "no TTL: another host's lease holds until released"
    assert holder_alive(marker.name[65:-len(PIN_SUFFIX)], old, 300.0)
    assert not holder_alive(marker.name[65:-len(PIN_SUFFIX)], old, 60.0)
    ttl = DiskTier(tmp_path / "d", None, fsync=False, lease_ttl_s=60.0)
    assert not ttl.is_pinned("k") and not marker.exists(), "a lapsed foreign lease is reclaimed"
    # our own leases are renewed
    assert ttl.pin("k") and ttl.is_pinned("k")
    own = next(tier.path.glob(f"*{PIN_SUFFIX}"))
    os.utime(own, (old, old))
    assert ttl.renew_leases() == 1 and own.stat().st_mtime > old + 60
    assert ttl.unpin("k") and not ttl.is_pinned("k")
    # two tier instances in one process hold separate leases
    a, b = DiskTier(tmp_path / "d", None, fsync=False), DiskTier(tmp_path / "d", None, fsync=False)
    assert a.pin("k") and b.pin("k") and a.unpin("k") and a.is_pinned("k")
    assert b.unpin("k") and not a.is_pinned("k")
    with pytest.raises(ValueError, match="lease_ttl_s"):
        DiskTier(tmp_path / "d", None, lease_ttl_s=0)
