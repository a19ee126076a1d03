"""Patch signatures and store keys (contextdeque/patch/keys.py): one signature function, the kind
says what a stacked patch adds, the key carries its scheme version, so an entry written under
the previous scheme is never served (a miss: the patch is formed again)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
from helpers import micro_llama

from contextdeque.core.errors import CorruptEntryError, PatchError
from contextdeque.model.hf import HFBackend
from contextdeque.patch import PATCH_KEY_VERSION, Patch, antecedent_signature, patch_key_parts, patch_signature
from contextdeque.patch.keys import rank_tag
from contextdeque.stores import DiskTier, MemoryTier, StoreEntry, StoreKey, TieredStore
from contextdeque.window import ContextWindow

A, B = [5, 6, 7, 8, 9, 10], [11, 12, 13, 14]


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    return HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-keys-llama")


def test_signature_is_stable_and_injective() -> None:
    sig = antecedent_signature(["a", "b"])
    assert sig == antecedent_signature(["a", "b"]) and len(sig) == 64
    assert sig != antecedent_signature(["b", "a"])
    assert antecedent_signature(["a", "b"], ordered=False) == antecedent_signature(["b", "a"], ordered=False)
    assert antecedent_signature(["a", "b"], ordered=False) != antecedent_signature(["a", "b"])
    assert antecedent_signature(["ab"]) != antecedent_signature(["a", "b"])
    assert antecedent_signature([]) != antecedent_signature([""])
    # ids and extra parts never alias
    assert antecedent_signature(["a", "x"]) != antecedent_signature(["a"], extra=["x"])
    with pytest.raises(PatchError):
        antecedent_signature([1])  # type: ignore[list-item]


def test_the_kind_says_what_a_stacked_patch_adds() -> None:
    ids = ["c1", "c2"]
    assert patch_signature("removal", ids, base_ids=["p1"]) != patch_signature("removal", ids, base_ids=["p2"])
    assert patch_signature("removal", ids, base_ids=["p1"]) != patch_signature("removal", ids)
    # not stacked: the base is not part of what an exact patch means
    assert patch_signature("exact", ids, base_ids=["p1"]) == patch_signature("exact", ids)
    # orbit patches are keyed by the antecedent set
    assert patch_signature("orbit", ids) == patch_signature("orbit", ids[::-1])
    assert patch_signature("exact", ids) != patch_signature("exact", ids[::-1])
    assert patch_signature("exact", ids, context=["regime:exact"]) != patch_signature("exact", ids, context=["regime:approx"])
    with pytest.raises(PatchError):
        patch_signature("nope", ids)


def test_key_parts_carry_the_version_and_validate_ranks() -> None:
    parts = patch_key_parts("chunk/fp/abc", "sig", "exact", (16, 32))
    assert parts == (f"v{PATCH_KEY_VERSION}", "chunk/fp/abc", "sig", "exact", "r16-32")
    assert str(StoreKey("patch", parts)) == f"patch/v{PATCH_KEY_VERSION}/chunk%2Ffp%2Fabc/sig/exact/r16-32"
    assert rank_tag(16) == "16"
    for bad in (-1, (), (1, -2), (True,), 1.5):
        with pytest.raises(PatchError):
            rank_tag(bad)  # type: ignore[arg-type]


def test_stored_patch_whose_ranks_disagree_with_its_factors_is_corrupt(backend) -> None:
    win = ContextWindow(backend, rank=2, patch_policy="eager", store=TieredStore([MemoryTier("cpu", None, name="device")]))
    win.append(token_ids=A)
    (cond,) = win.slot(win.append(token_ids=B)).stack
    tensors, meta = cond.patch.to_entry()
    assert Patch.from_entry(tensors, meta).id == cond.patch.id
    for field, value in (("rank_k", "3"), ("rank_v", "1"), ("n_tokens", "5"), ("layers", "[0]"), ("k_shape", "[2, 9]")):
        with pytest.raises(CorruptEntryError):
            Patch.from_entry(tensors, {**meta, field: value})


def _v1_key(chunk_key: str, regime: str, antecedent_ids: list[str], kind: str, rtag: str) -> str:
    """The store key scheme before PATCH_KEY_VERSION 2 (no version part; the window's own
    sha256 over ``regime:``, the ids and ``base:`` parts)."""
    h = hashlib.sha256(b"cdq-antecedents-v1\0o")
    for i in [f"regime:{regime}", *antecedent_ids]:
        b = i.encode()
        h.update(len(b).to_bytes(8, "little") + b)
    return str(StoreKey("patch", (chunk_key, h.hexdigest(), kind, rtag)))


def test_entries_of_the_previous_key_scheme_are_misses(tmp_path, backend, one_thread) -> None:
    def store():
        return TieredStore([MemoryTier("cpu", None, name="device"), DiskTier(tmp_path / "s", None, fsync=False)])

    first = ContextWindow(backend, rank=2, patch_policy="eager", store=store())
    a = first.append(token_ids=A)
    b = first.append(token_ids=B)
    (cond,) = first.slot(b).stack
    version, chunk_key, _, kind, rtag = StoreKey.parse(cond.key).parts
    assert version == f"v{PATCH_KEY_VERSION}"
    old_key = _v1_key(chunk_key, first.context.policy.regime, [first.chunk(a).id], kind, rtag)
    assert old_key != cond.key
    # what an older contextdeque would have left under its key for this context: a patch with
    # another content, so serving it would be a silent error
    wrong = dataclasses.replace(cond.patch, k_u=-cond.patch.k_u, v_u=-cond.patch.v_u)
    disk = first.store.store.tier("disk")
    disk.put(old_key, StoreEntry(*wrong.to_entry()))
    disk.delete(cond.key)

    win = ContextWindow(backend, rank=2, patch_policy="eager", store=store())  # a new process: nothing in memory
    win.append(token_ids=A)
    b2 = win.append(token_ids=B)
    assert b2.receipt.patches_formed == 1 and b2.receipt.patches_reused == 0
    (got,) = win.slot(b2).stack
    assert got.key == cond.key
    assert torch.equal(got.patch.k_u, cond.patch.k_u) and torch.equal(got.patch.v_u, cond.patch.v_u)
    assert torch.equal(disk.get(old_key).tensors["k_u"], wrong.k_u)  # left alone, never served
