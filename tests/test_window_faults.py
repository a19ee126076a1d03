"""Issue 10 item 3: window operations under store faults (a read-only directory, a full disk, a
write that fails half-way). Every operation either succeeds or raises a package error; after a
failure the window and the store's hold counts are exactly as before; no entry whose write
returned is lost; the window keeps working once the fault is gone."""

from __future__ import annotations

from collections import Counter

import pytest
from faults import FAULTS, inject
from helpers import micro_llama

from contextdeque.core.errors import ContextDequeError
from contextdeque.model.hf import HFBackend
from contextdeque.stores import DiskTier, MemoryTier, TieredStore
from contextdeque.window import ContextWindow

A, B, C, D = [5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24]
E, F, G = [30, 31, 32, 33], [40, 41, 42], [43, 44, 45, 46]


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    return HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-faults-llama")


def make(tmp_path, backend, config: str, policy: str = "eager"):
    disk = DiskTier(tmp_path / "store", None, fsync=False)
    if config == "write_through":  # every put also reaches the disk
        store = TieredStore([MemoryTier("cpu", None, name="device"), disk], write_through=True)
    elif config == "demote":  # entries reach the disk when their last holder lets go
        store = TieredStore([MemoryTier("cpu", None, name="device"), disk])
    else:  # a small memory tier: puts spill their victims to the disk
        store = TieredStore([MemoryTier("cpu", 6000, name="device"), disk])
    win = ContextWindow(backend, rank=2, store=store, patch_policy=policy)
    refs = [win.append(token_ids=ids) for ids in (A, B, C, D)]
    win.evict(refs[3])
    return win, store, refs


def _fork_commit(win, refs):
    child = win.fork()
    child.slide(1)
    child.commit()


OPS = {
    "append_new": lambda w, r: w.append(token_ids=E),
    "append_seen": lambda w, r: w.append(token_ids=A),
    "extend": lambda w, r: w.extend([{"token_ids": F}, {"token_ids": G}]),
    "slide": lambda w, r: w.slide(1),
    "evict": lambda w, r: w.evict(r[1]),
    "recall": lambda w, r: w.recall(r[3], at=0),
    "reorder": lambda w, r: w.reorder(list(reversed(w.refs))),
    "refresh": lambda w, r: w.refresh([r[2]]),
    "purge": lambda w, r: w.purge(r[3]),
    "fork_commit": _fork_commit,
    "close": lambda w, r: w.close(),
    "materialize": lambda w, r: w.materialize(),
    "generate": lambda w, r: w.generate([50, 51], max_new_tokens=2, chat=False),
    "is_disposable": lambda w, r: w.is_disposable(r[2], [50, 51], max_new_tokens=2, drop=True, chat=False),
    "heal": lambda w, r: w.heal(),
}


def observe(win):
    return (win.refs, win.evicted_refs, win.placement(), win.generation, win.closed)


def holds(win) -> Counter:
    return Counter({k: v for k, v in win.store._holds.items() if v})


@pytest.mark.parametrize("config", ["write_through", "demote", "spill"])
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("op", sorted(OPS))
def test_fault_matrix(tmp_path, backend, one_thread, config, fault, op):
    run_case(tmp_path, backend, config, fault, op)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("op", ["append_new", "heal", "slide", "recall", "reorder"])
def test_fault_matrix_latency_first(tmp_path, backend, one_thread, fault, op):
    """The same invariants under the latency-first policy (provisional appends, deferred healing)."""
    run_case(tmp_path, backend, "demote", fault, op, policy="latency")


def run_case(tmp_path, backend, config, fault, op, policy="eager"):
    win, store, refs = make(tmp_path, backend, config, policy)
    before, held = observe(win), holds(win)
    present = {k: store.get(k) for k in store.keys()}
    returned: list[str] = []
    real_put = store.put

    def recording_put(key, entry, **kw):
        real_put(key, entry, **kw)
        returned.append(key)  # this write returned: it must not be lost

    store.put = recording_put
    try:
        with inject(fault, tmp_path / "store"):
            OPS[op](win, refs)
    except ContextDequeError:
        assert observe(win) == before, f"{op} under {fault} changed the window"
        assert holds(win) == held, f"{op} under {fault} changed the store's holds"
    finally:
        store.put = real_put
    # holds always mirror what the window's slots hold
    expected = Counter() if win.closed else +win._state.held_keys()
    assert holds(win) == expected
    for key in [*present, *returned]:
        entry = store.get(key)
        assert entry is not None, f"{key} lost after {op} under {fault}"
    for key, old in present.items():
        new = store.get(key)
        assert new.meta.get("content_digest") == old.meta.get("content_digest")
    if not win.closed:  # the fault is gone: the window goes on
        win.append(token_ids=[50, 51, 52])
        win.materialize()
        assert holds(win) == +win._state.held_keys()


def test_readonly_slide_keeps_holds_and_demotes_later(tmp_path, backend, one_thread):
    """The issue's reproducer: with the store's directory read-only, ``slide`` used to raise
    StorePermissionError after its body ran, leaving the slid chunk's hold count dropped with the
    window unchanged (a later evict then never demoted it, and recall failed)."""
    store = TieredStore([MemoryTier("cpu", None, name="device"), DiskTier(tmp_path / "s", None, fsync=False)])
    win = ContextWindow(backend, rank=2, store=store)
    a = win.append(token_ids=A)
    b = win.append(token_ids=B)
    key_a = win.store.chunk_key(win.chunk(a))
    with inject("readonly", tmp_path / "s"):
        rec = win.slide(1)
        assert rec.left == (a,)
        assert any("deferred" in n for n in rec.notes), rec.notes
        assert holds(win)[key_a] == 0
        assert store.where(key_a) == ["device"]  # not demoted, not lost
        assert holds(win) == +win._state.held_keys()
        win.recall(a)  # served from the device tier; nothing needs the disk
        win.evict(a)
    assert store.where(key_a) == ["device"]
    win.evict(b)  # the first release after the fault: the deferred demotion happens
    assert store.where(key_a) == ["disk"]
    win.recall(a)
    assert a in win.refs and store.where(key_a)[0] == "device"
