"""Compressed-at-rest chunks (KVCapsule, linear variant): exact at full retention, reconstruction
commutes with relocation and composes with the patch, bases are saved safely and refused when they
do not fit, and the kvcapsule-linear arm."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import seeded_ids

from contextdeque import form_patch, relocate
from contextdeque.core.capsule import (
    CalibrationStats,
    CapsuleBank,
    CapsuleBasis,
    CapsuleChunk,
    fit_capsule,
    kept_rows,
    pivoted_rows,
    pyramid,
    reconstruction_error,
)
from contextdeque.core.errors import CapsuleError, CorruptEntryError, FingerprintMismatchError
from contextdeque.core.operator import to_content_frame

pytestmark = pytest.mark.usefixtures("one_thread")

T = 40


@pytest.fixture(scope="module")
def be(tiny_backend_factory):
    return tiny_backend_factory("llama")


@pytest.fixture(scope="module")
def cal(be):
    return [be.encode(token_ids=seeded_ids(T, 100 + i)) for i in range(6)]


@pytest.fixture(scope="module")
def chunk(be):
    return be.encode(token_ids=seeded_ids(T, 7))


def _same(a, b):
    return all(torch.equal(x, y) for (x, y) in zip(a, b))


def test_full_retention_reconstructs_exactly(cal, chunk):
    basis = fit_capsule(cal, 1.0)
    assert basis.retention == (1.0,) * chunk.num_layers and all(basis.full(l) for l in range(chunk.num_layers))
    cap = basis.compress(chunk)
    rec = basis.reconstruct(cap)
    assert torch.equal(rec.keys, chunk.keys) and torch.equal(rec.values, chunk.values)
    assert rec.id == chunk.id and rec.meta["capsule_basis"] == basis.id
    for s in (3, 97, 1000):
        got, want = relocate(rec, s), relocate(chunk, s)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))


def test_partial_retention_keeps_its_rows_exactly_and_saves_bytes(cal, chunk):
    errs = []
    for ret in (0.2, 0.5, 0.8, 1.0):
        basis = fit_capsule(cal, ret)
        cap = basis.compress(chunk)
        rec = basis.reconstruct(cap)
        for l in range(chunk.num_layers):
            rows = basis.key_rows[l]
            assert rows.shape[1] == kept_rows(basis.retention[l], T)
            kept = torch.gather(chunk.keys[l], 1, rows.unsqueeze(-1).expand(-1, -1, chunk.keys.shape[-1]))
            assert torch.equal(torch.gather(rec.keys[l], 1, rows.unsqueeze(-1).expand(-1, -1, rec.keys.shape[-1])), kept)
        errs.append(reconstruction_error(chunk, rec))
        if ret < 1.0:
            assert cap.nbytes < chunk.nbytes
    ek = [e[0] for e in errs]
    ev = [e[1] for e in errs]
    assert ek[0] > ek[1] > ek[2] > ek[3] == 0.0 and ev[0] > ev[1] > ev[2] > ev[3] == 0.0
    # in-sample: the basis spans its own calibration chunks well at generous retention
    basis = fit_capsule(cal, 0.9, spread=0.0)
    assert reconstruction_error(cal[0], basis.reconstruct(basis.compress(cal[0])))[1] < ev[2]


def test_reconstruction_commutes_with_relocation(be, cal, chunk):
    """Reconstruct in the content frame, then rotate: a capsule placed at any start is the
    reconstructed chunk placed there; and a page un-rotated from any position compresses to the
    same capsule (the compression never sees a position)."""
    basis = fit_capsule(cal, 0.4)
    cap = basis.compress(chunk)
    rec = basis.reconstruct(cap)
    for s in (3, 250, 4000):
        assert _pairs_equal(basis.relocate(cap, s), relocate(rec, s))
    # reconstruction after relocation: place at s, back to the content frame, compress, reconstruct, place at s2
    for s, s2 in ((3, 250), (600, 17)):
        page = relocate(chunk, s)
        keys, values = to_content_frame(page, be.layout, chunk.positions(s))
        moved = dataclasses.replace(chunk, keys=keys.to(chunk.storage_dtype), values=values.to(chunk.storage_dtype))
        again = basis.relocate(basis.compress(moved), s2)
        for (k, v), (k2, v2) in zip(again, relocate(rec, s2)):
            assert torch.allclose(k, k2, atol=1e-4, rtol=1e-4) and torch.allclose(v, v2, atol=1e-5, rtol=1e-5)


def _pairs_equal(a, b):
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_compressed_canonical_composes_with_the_patch(be, cal, chunk):
    ante = be.encode(token_ids=seeded_ids(30, 8))
    patch = form_patch(be, chunk, antecedents=[ante], rank=8)
    exact = fit_capsule(cal, 1.0)
    rec = exact.reconstruct(exact.compress(chunk))
    assert _pairs_equal(relocate(rec, 33, patch=patch), relocate(chunk, 33, patch=patch))
    basis = fit_capsule(cal, 0.5)
    rec = basis.reconstruct(basis.compress(chunk))
    # the patch adds the same rank-m correction on top of the reconstruction as on the original
    for (kp, vp), (kb, vb), (ko, vo), (kob, vob) in zip(relocate(rec, 33, patch=patch), relocate(rec, 33),
                                                        relocate(chunk, 33, patch=patch), relocate(chunk, 33)):
        assert torch.allclose(kp - kb, ko - kob, atol=1e-5) and torch.allclose(vp - vb, vo - vob, atol=1e-5)


def test_pivoted_rows_from_the_gram_match_greedy_qr_on_the_rows():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(3, 20, 9, generator=g, dtype=torch.float64) @ torch.randn(3, 9, 30, generator=g, dtype=torch.float64)
    picks = pivoted_rows(X @ X.transpose(1, 2), 9)
    for h in range(3):  # reference: Gram-Schmidt on the rows, largest residual first
        res, want = X[h].clone(), []
        for _ in range(9):
            n = (res * res).sum(-1)
            n[want] = -1
            p = int(n.argmax())
            want.append(p)
            q = res[p] / res[p].norm()
            res -= torch.outer(res @ q, q)
        assert picks[h].tolist() == want


def test_calibration_prefix_stats_are_the_truncated_chunks_stats(cal):
    full = CalibrationStats.from_chunks(cal)
    cut = [dataclasses.replace(c, keys=c.keys[:, :, :25].contiguous(), values=c.values[:, :, :25].contiguous(),
                               rel_positions=c.rel_positions[:, :25]) for c in cal]
    a, b = full.prefix(25), CalibrationStats.from_chunks(cut)
    assert torch.allclose(a.key_gram, b.key_gram) and torch.allclose(a.value_gram, b.value_gram)
    ba, bb = fit_capsule(a, 0.5), fit_capsule(b, 0.5)
    assert all(torch.equal(x, y) for x, y in zip(ba.key_rows, bb.key_rows))
    with pytest.raises(CapsuleError):
        full.prefix(T + 1)


def test_save_load_round_trip_and_refusals(tmp_path, be, cal, chunk, tiny_backend_factory):
    basis = fit_capsule(cal, 0.4)
    path = basis.save(tmp_path / "b" / "basis.safetensors")
    assert [p.name for p in path.parent.iterdir()] == ["basis.safetensors"]  # no temp file left behind
    back = CapsuleBasis.load(path, fingerprint=be.fingerprint, layout_signature=be.layout.signature, n_tokens=T)
    assert back.id == basis.id and back.retention == basis.retention
    cap = basis.compress(chunk)
    assert _same([back.reconstruct(cap).keys], [basis.reconstruct(cap).keys])
    # another model, another chunk length: typed refusals
    other = tiny_backend_factory("llama", seed=1)
    with pytest.raises(FingerprintMismatchError):
        CapsuleBasis.load(path, fingerprint=other.fingerprint)
    with pytest.raises(FingerprintMismatchError):
        basis.compress(other.encode(token_ids=seeded_ids(T, 7)))
    with pytest.raises(CapsuleError, match="fitted for chunks of 40"):
        CapsuleBasis.load(path, n_tokens=T + 1)
    with pytest.raises(CapsuleError, match="fitted for chunks of 40"):
        basis.compress(be.encode(token_ids=seeded_ids(T + 3, 7)))
    with pytest.raises(ValueError):  # CapsuleError is a ValueError
        basis.compress(be.encode(token_ids=seeded_ids(5, 1)))
    # a capsule from another basis
    with pytest.raises(CapsuleError, match="compressed with basis"):
        fit_capsule(cal, 0.6).reconstruct(cap)
    # corrupt files: flipped tensor byte, truncation, edited metadata, not safetensors at all
    data = path.read_bytes()
    bad = bytearray(data)
    bad[-5] ^= 0x55
    (tmp_path / "flip.safetensors").write_bytes(bytes(bad))
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.safetensors").write_bytes(b"not a basis")
    edited = data.replace(b'"n_tokens":"40"', b'"n_tokens":"41"')
    assert edited != data
    (tmp_path / "edit.safetensors").write_bytes(edited)
    for name in ("flip", "cut", "junk", "edit"):
        with pytest.raises(CorruptEntryError):
            CapsuleBasis.load(tmp_path / f"{name}.safetensors")


def test_bad_retentions_are_refused(cal):
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(CapsuleError):
            fit_capsule(cal, bad)
    with pytest.raises(CapsuleError):
        fit_capsule(cal, [0.5])  # one ratio for a 2-layer model
    with pytest.raises(CapsuleError):
        fit_capsule([])
    with pytest.raises(CapsuleError):
        pyramid(4, 0.5, spread=1.0)
    assert pyramid(3, 0.4, 0.5) == pytest.approx([0.6, 0.4, 0.2])


def test_capsules_are_store_entries(tmp_path, cal, chunk):
    from contextdeque.stores import DiskTier, StoreEntry, TieredStore

    basis = fit_capsule(cal, 0.4)
    cap = basis.compress(chunk)
    store = TieredStore([DiskTier(tmp_path, None)])
    tensors, meta = cap.to_entry()
    store.put("capsule/x", StoreEntry(tensors, meta))
    entry = store.get("capsule/x", expect_fingerprint=chunk.fingerprint)
    back = CapsuleChunk.from_entry(dict(entry.tensors), dict(entry.meta))
    assert back.nbytes == cap.nbytes
    rec, rec2 = basis.reconstruct(cap), basis.reconstruct(back)
    assert torch.equal(rec.keys, rec2.keys) and torch.equal(rec.values, rec2.values)
    assert torch.equal(rec2.token_ids, chunk.token_ids) and rec2.span == chunk.span
    with pytest.raises(CorruptEntryError):
        CapsuleChunk.from_entry(dict(entry.tensors), {**dict(entry.meta), "kind": "chunk"})


def test_kvcapsule_arm(be, cal):
    from contextdeque.eval.arms import ARMS, PatchArm, ReuseRequest, make_arm
    from contextdeque.core.errors import ReuseArmError

    assert "kvcapsule-linear" in ARMS
    chunks = [be.encode(token_ids=seeded_ids(T, s)) for s in (51, 52, 53)]
    req = ReuseRequest(be, chunks)
    exact = CapsuleBank(1.0, calibrate=lambda c: cal)
    got = make_arm("kvcapsule-linear", bank=exact, rank=8).run(req)
    want = PatchArm(8).run(req)
    assert _pairs_equal(got.kv, want.kv)  # full retention: the patch arm's KV, bit for bit
    assert got.report.extras["recon_error_k"] == 0.0 and got.report.extras["bytes_saved_fraction"] < 0.0
    lossy = CapsuleBank(0.4, calibrate=lambda c: CalibrationStats.from_chunks(cal))
    res = make_arm("kvcapsule-linear", bank=lossy, rank=None).run(req)
    assert res.report.arm == "kvcapsule-linear-blind" and res.report.forwards == 0
    assert 0.4 < res.report.extras["bytes_saved_fraction"] < 0.7
    assert res.report.extras["recon_error_v"] > 0 and res.report.bytes_canonical < req.page_bytes
    assert len(lossy) == 1  # one basis for the one chunk shape
    with pytest.raises(CapsuleError, match="no capsule basis"):
        make_arm("kvcapsule-linear", bank=CapsuleBank(0.4), rank=None).run(req)
    with pytest.raises(ReuseArmError):
        make_arm("kvcapsule-linear", bank="not a bank")
