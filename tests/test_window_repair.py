"""Issue 10 item 3 (second half): a corrupt or missing store entry is quarantined and rebuilt from
its source (re-encode the content, re-form the patch) where the window still has the source, with
the repair in the receipt; it surfaces as an error only when the source is gone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import micro_llama

from contextdeque.core.errors import UnknownRefError
from contextdeque.model.hf import HFBackend
from contextdeque.stores import DiskTier, MemoryTier, TieredStore
from contextdeque.stores.disk import QUARANTINE_DIR
from contextdeque.window import ContextWindow

A, B = [5, 6, 7, 8, 9, 10], [11, 12, 13, 14]


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    return HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-repair-llama")


def store_on(path, write_through=True) -> TieredStore:
    return TieredStore([MemoryTier("cpu", None, name="device"), DiskTier(path, None, fsync=False)], write_through=write_through)


def flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_canonical_is_quarantined_and_re_encoded(tmp_path, backend, one_thread):
    """The issue's reproducer: after a flipped byte, appending the same content raised
    CorruptEntryError in every window until someone ran scrub() by hand."""
    first = ContextWindow(backend, rank=2, store=store_on(tmp_path / "s"), patch_policy="eager")
    ref = first.append(token_ids=A)
    key = first.store.chunk_key(first.chunk(ref))
    disk = first.store.store.tier("disk")
    flip_last_byte(disk.file_for(key))

    store = store_on(tmp_path / "s")  # a new process's view: nothing in memory
    win = ContextWindow(backend, rank=2, store=store, patch_policy="eager")
    enc = win.context.counters.encodes
    again = win.append(token_ids=A)
    rec = again.receipt
    assert win.context.counters.encodes == enc + 1
    assert any("quarantined" in r for r in rec.repairs), rec.repairs
    assert any("re-encoded" in r for r in rec.repairs), rec.repairs
    assert "repair" in rec.summary()
    assert len(list((tmp_path / "s" / QUARANTINE_DIR).iterdir())) == 1  # kept aside for inspection
    assert disk.get(key) is not None  # rebuilt on disk (write-through), verifies again
    assert torch.equal(win.chunk(again).keys, first.chunk(ref).keys)
    # a third window finds the good copy: no repair, no encode
    third = ContextWindow(backend, rank=2, store=store_on(tmp_path / "s"), patch_policy="eager")
    assert third.append(token_ids=A).receipt.repairs == ()


def test_corrupt_patch_is_re_formed(tmp_path, backend, one_thread):
    first = ContextWindow(backend, rank=2, store=store_on(tmp_path / "s"), patch_policy="eager")
    first.append(token_ids=A)
    b = first.append(token_ids=B)
    (cond,) = first.slot(b).stack
    disk = first.store.store.tier("disk")
    flip_last_byte(disk.file_for(cond.key))

    win = ContextWindow(backend, rank=2, store=store_on(tmp_path / "s"), patch_policy="eager")
    win.append(token_ids=A)
    rec = win.append(token_ids=B).receipt
    assert rec.patches_formed == 1 and rec.patches_reused == 0
    assert any("re-formed" in r for r in rec.repairs) and any("quarantined" in r for r in rec.repairs)
    assert disk.get(cond.key) is not None


def test_missing_canonical_is_re_encoded_on_recall(tmp_path, backend, one_thread):
    win = ContextWindow(backend, rank=2, store=store_on(tmp_path / "s", write_through=False))
    a = win.append(token_ids=A)
    win.append(token_ids=B)
    page_before = [(k.clone(), v.clone()) for k, v in win.kv(a)]
    win.evict(a)
    key = win.store.chunk_key(a.chunk_id, win.context.fingerprint)
    assert win.store.store.where(key) == ["disk"]
    win.store.store.tier("disk").file_for(key).unlink()  # deleted behind the store's back
    enc = win.context.counters.encodes
    rec = win.recall(a, at=0)
    assert win.context.counters.encodes == enc + 1
    assert any("re-encoded" in r for r in rec.repairs), rec.repairs
    for (k0, v0), (k1, v1) in zip(page_before, win.kv(a)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_error_only_when_the_source_is_gone(tmp_path, backend, one_thread):
    win = ContextWindow(backend, rank=2, store=store_on(tmp_path / "s", write_through=False))
    a = win.append(token_ids=A)
    win.append(token_ids=B)
    win.evict(a)
    key = win.store.chunk_key(a.chunk_id, win.context.fingerprint)
    win.store.store.tier("disk").file_for(key).unlink()
    win._state.evicted[a] = dataclasses.replace(win._state.evicted[a], source=None)  # e.g. an old session
    before = (win.refs, win.evicted_refs, win.generation)
    with pytest.raises(UnknownRefError, match="no source") as exc:
        win.recall(a)
    assert "budget" not in str(exc.value)  # not blamed on a budget the store does not have
    assert (win.refs, win.evicted_refs, win.generation) == before
