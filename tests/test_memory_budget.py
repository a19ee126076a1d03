"""Issue 10: the memory budget bounds the process, not only the store. A window's placed pages
are counted against the store's memory tier (`MemoryTier.reserve`), and heap pages that tensors
freed go back to the OS (`core.heap`) instead of staying resident in glibc's free lists."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import micro_llama, seeded_ids

from contextdeque.core import heap
from contextdeque.core.errors import StoreCapacityError
from contextdeque.eval.soak import rss_bytes
from contextdeque.model.hf import HFBackend
from contextdeque.stores import HostTier, MemoryTier, StoreEntry, TieredStore
from contextdeque.window import ContextWindow


def _entry(nbytes: int) -> StoreEntry:
    return StoreEntry({"x": torch.zeros(nbytes // 4)}, {"content_digest": str(nbytes)})


def test_reserved_bytes_come_out_of_the_budget():
    tier = MemoryTier("cpu", 10_000)
    tier.reserve("w", 6_000)
    assert tier.reserved_bytes == 6_000
    with pytest.raises(StoreCapacityError, match="reserved"):
        tier.put("a", _entry(5_000))
    tier.put("b", _entry(3_000))
    tier.put("c", _entry(3_000))  # evicts b: 4,000 B of room
    assert tier.keys() == ["c"]
    tier.reserve("w", 0)  # given back
    assert tier.reserved_bytes == 0
    tier.put("a", _entry(5_000))
    assert sorted(tier.keys()) == ["a", "c"]


def test_a_window_reserves_its_pages_while_it_lives(one_thread):
    backend = HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-budget-llama")
    lay = backend.layout
    per_token = 4 * lay.num_layers * (lay.k_heads * lay.k_dim + lay.v_heads * lay.v_dim)
    device, host = MemoryTier("cpu", 1 << 20, name="device"), HostTier(1 << 20, name="host")
    store = TieredStore([device, host])
    win = ContextWindow(backend, budget_tokens=40, store=store, patch_policy="eager")
    assert device.reserved_bytes == 40 * per_token and host.reserved_bytes == 0
    latency = ContextWindow(backend, budget_tokens=10, store=store, patch_policy="latency")
    assert device.reserved_bytes == 40 * per_token + 10 * 2 * per_token  # + its provisional KV
    del latency
    gc.collect()
    fork = win.fork()  # one family, one reservation
    assert device.reserved_bytes == 40 * per_token
    ContextWindow(backend, store=store)  # no token budget: nothing to bound, nothing reserved
    assert device.reserved_bytes == 40 * per_token
    win.append(token_ids=seeded_ids(6, 1, vocab=60).tolist())
    del win, fork
    gc.collect()
    assert device.reserved_bytes == 0


_RETAINED = """
import ctypes, gc, json, sys
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: 4 MiB blocks come from the heap, as in a long run
libc.mallopt(-1, 1 << 30)   # M_TRIM_THRESHOLD: free() never shrinks the heap by itself
import torch
from contextdeque.core import heap
from contextdeque.eval.soak import rss_bytes
big, keep = [], []
for _ in range(64):  # 256 MiB of pages, each followed by a live small tensor
    big.append(torch.ones(1 << 20))
    keep.append(torch.ones(16))
loaded = rss_bytes()
del big
gc.collect()
freed = rss_bytes()
trimmed = heap.release_freed_heap(force=True)
again = heap.release_freed_heap()
print(json.dumps({"loaded": loaded, "freed": freed, "after": rss_bytes(), "trimmed": trimmed, "again": again}))
"""


@pytest.mark.skipif(not heap.heap_trim_available(), reason="not glibc: malloc_trim does not exist")
def test_freed_heap_goes_back_to_the_os(monkeypatch):
    """In a child whose allocator behaves as after hours of churn (pages served from the heap,
    no automatic trimming), 256 MiB of freed pages stay resident until `release_freed_heap`."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RETAINED], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["loaded"] - r["freed"] < 32 << 20, r  # free() alone gave back (almost) nothing
    assert r["freed"] - r["after"] >= 200 << 20, r  # the trim gave back the pages
    assert r["trimmed"] and not r["again"], "rate-limited: a second call at once does nothing"
    monkeypatch.setenv(heap.HEAP_TRIM_ENV, "0")
    assert not heap.release_freed_heap(force=True)
