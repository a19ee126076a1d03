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
    ridge_solve,
)
from contextdeque.core.errors import CapsuleError, CorruptEntryError, FingerprintMismatchError
from contextdeque.core.chunk import Chunk
from contextdeque.core.operator import to_content_frame

pytestmark = pytest.mark.usefixtures("one_thread")

T = 40


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
    for s in (3, 97, 400):  # inside the tiny model's 512 trained positions
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
    for s in (3, 250, 450):  # inside the tiny model's 512 trained positions
        assert _pairs_equal(basis.relocate(cap, s), relocate(rec, s))
    # reconstruction after relocation: place at s, back to the content frame, compress, reconstruct, place at s2
    for s, s2 in ((3, 250), (440, 17)):
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


def test_ridge_solve_on_a_singular_gram_is_the_least_squares_map():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(2, 12, 3, generator=g, dtype=torch.float64)  # 12 rows spanning 3 directions
    gram = X @ X.transpose(1, 2)  # [2, 12, 12], rank 3: no Cholesky without a ridge
    gram[1] = 0.0  # and an all-zero head (what a dead head's keys give)
    rhs = torch.randn(2, 12, 5, generator=g, dtype=torch.float64)
    assert int(torch.linalg.cholesky_ex(gram)[1][0]) > 0
    out = ridge_solve(gram, rhs, 0.0)
    assert torch.allclose(out, torch.linalg.pinv(gram, hermitian=True) @ rhs, atol=1e-8)
    assert torch.isfinite(ridge_solve(gram, rhs, 1e-6)).all()
    with pytest.raises(CapsuleError):
        ridge_solve(torch.full((1, 3, 3), float("inf"), dtype=torch.float64), rhs[:1, :3], 1e-6)


def test_a_rank_deficient_calibration_set_fits_and_reconstructs_its_span(be):
    # one calibration chunk repeated, its first head's keys all one row (rank 1) and its second
    # head's keys zero: every retained-row Gram is singular
    c = be.encode(token_ids=seeded_ids(T, 3))
    keys = c.keys.clone()
    keys[:, 0] = keys[:, 0, :1]
    if keys.shape[1] > 1:
        keys[:, 1] = 0.0
    deficient = dataclasses.replace(c, keys=keys.contiguous())
    basis = fit_capsule([deficient, deficient, deficient], 0.4)
    assert all(torch.isfinite(m).all() for m in basis.key_map)
    rebuilt = basis.reconstruct(basis.compress(deficient))
    assert torch.isfinite(rebuilt.keys).all() and torch.isfinite(rebuilt.values).all()
    assert torch.allclose(rebuilt.keys[:, 0].to(torch.float64), keys[:, 0].to(torch.float64), rtol=1e-4, atol=1e-5)
    with pytest.raises(CapsuleError):
        bad = CalibrationStats.from_chunks([c])
        fit_capsule(dataclasses.replace(bad, key_gram=bad.key_gram * float("nan")), 0.4)


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


# ---------------------------------------------------------------------------- compressed at rest in a tier


def _entry(c):
    from contextdeque.stores import StoreEntry

    tensors, meta = c.to_entry()
    return StoreEntry(tensors, meta)


def test_capsule_tier_keeps_chunks_compressed_and_reads_back_reconstructions(tmp_path, be, cal, chunk):
    from contextdeque.stores import TIERS, CapsuleTier, DiskTier, make_tier
    from contextdeque.window.store import WindowStore

    assert TIERS["capsule"] is CapsuleTier
    basis = fit_capsule(cal, 0.4)
    bank = CapsuleBank()
    bank.add(basis)
    tier = make_tier("capsule", inner="disk", bank=bank, path=tmp_path / "d", budget_bytes=None)
    key = WindowStore.chunk_key(chunk)
    tier.put(key, _entry(chunk))
    raw = DiskTier(tmp_path / "d", None).get(key)
    plain = DiskTier(tmp_path / "plain", None)
    plain.put(key, _entry(chunk))
    assert raw.kind == "capsule" and raw.nbytes < _entry(chunk).nbytes  # the capsule is what is stored
    assert tier.nbytes() < plain.nbytes()  # and what the tier's budget counts
    got = tier.get(key, expect_fingerprint=chunk.fingerprint, expect_digest=chunk.id)
    back = Chunk.from_entry(dict(got.tensors), dict(got.meta))
    want = basis.reconstruct(basis.compress(chunk))
    assert torch.equal(back.keys, want.keys) and torch.equal(back.values, want.values) and back.id == chunk.id
    assert dict(tier.peek(key)) == dict(got.meta)  # peek answers as the reconstructed chunk's entry
    tier.put(key, _entry(chunk))  # the same chunk again: same capsule, no collision
    tier.put(key, got)  # the reconstruction compresses to the same capsule
    assert tier.contains(key) and tier.keys() == [key]
    # what has no basis is stored as it is: another chunk length, a patch
    other = be.encode(token_ids=seeded_ids(T + 5, 3))
    tier.put(WindowStore.chunk_key(other), _entry(other))
    same = tier.get(WindowStore.chunk_key(other))
    assert torch.equal(same.tensors["keys"], other.keys) and same.meta["content_digest"] == other.id
    patch = form_patch(be, chunk, antecedents=[other], rank=4)
    pt, pm = patch.to_entry()
    from contextdeque.stores import StoreEntry

    tier.put("patch/x", StoreEntry(pt, pm))
    assert all(torch.equal(tier.get("patch/x").tensors[k], v) for k, v in pt.items())
    with pytest.raises(FingerprintMismatchError):
        tier.get(key, expect_fingerprint="another-model")


def test_capsule_tier_at_full_retention_is_invisible_to_a_window(tmp_path, be, cal):
    """A window over [device, capsule(disk)] at full retention: evicted chunks go to disk
    compressed and come back (recall, extend with overlapped loads) bit for bit."""
    from contextdeque import ContextWindow
    from contextdeque.stores import CapsuleTier, DiskTier, MemoryTier, TieredStore

    ids = [seeded_ids(T, 300 + i) for i in range(4)]
    exact = CapsuleBank(1.0, calibrate=lambda c: cal)

    def store():
        return TieredStore([MemoryTier("cpu", None, name="device"), CapsuleTier(DiskTier(tmp_path, None), exact)])

    win = ContextWindow(be, rank=8, store=store(), patch_policy="eager")
    refs = [win.append(token_ids=x) for x in ids]
    plain = ContextWindow(be, rank=8, patch_policy="eager")
    for x in ids:
        plain.append(token_ids=x)
    win.evict(refs[1])
    s = win.store.store
    on_disk = {s.tiers[1].inner.get(k).kind for k in s.tiers[1].inner.keys()}
    assert on_disk == {"capsule", "patch"}  # demoted: the canonical compressed at rest, its patch as it is
    win.recall(refs[1], at=1)
    assert len(win.refs) == len(plain.refs) and all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for r, q in zip(win.refs, plain.refs) for a, b in zip(win.kv(r), plain.kv(q)))
    # a fresh window over the same disk: half the chunks compressed on disk, loaded in the background
    fresh = ContextWindow(be, rank=8, store=store(), patch_policy="eager")
    rec = fresh.extend([{"token_ids": x} for x in ids], overlap=True)
    assert rec.loading["by_tier"] == {"disk": 1} and not rec.load_fallbacks
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for r, q in zip(fresh.refs, plain.refs) for a, b in zip(fresh.kv(r), plain.kv(q)))


def test_capsule_tier_victims_spill_down_as_chunks_and_bases_persist(tmp_path, be, cal, chunk):
    from contextdeque.stores import CapsuleTier, DiskTier, HostTier, TieredStore
    from contextdeque.window.store import WindowStore

    basis = fit_capsule(cal, 0.4)
    bank = CapsuleBank()
    bank.add(basis)
    cap_bytes = CapsuleTier(HostTier(None), bank).encode(_entry(chunk)).nbytes
    assert cap_bytes < _entry(chunk).nbytes
    small = CapsuleTier(HostTier(cap_bytes + 10), bank, basis_dir=tmp_path / "bases")  # holds one capsule
    store = TieredStore([small, DiskTier(tmp_path / "disk", None)])
    a, b = chunk, be.encode(token_ids=seeded_ids(T, 8))
    store.put(WindowStore.chunk_key(a), _entry(a))
    assert store.where(WindowStore.chunk_key(a)) == [small.name]
    store.put(WindowStore.chunk_key(b), _entry(b))  # evicts a from the small tier: it spills to disk
    assert store.where(WindowStore.chunk_key(a)) == ["disk"]
    spilled = DiskTier(tmp_path / "disk", None).get(WindowStore.chunk_key(a))
    assert spilled.kind == "chunk"  # decoded on the way down: the disk tier holds a chunk entry
    assert [p.name for p in (tmp_path / "bases").iterdir()] == [f"{basis.id}.safetensors"]
    # a new process: an empty bank finds the basis in basis_dir; without it the capsule is unreadable
    inner = small.inner
    k = WindowStore.chunk_key(b)
    again = CapsuleTier(inner, CapsuleBank(), basis_dir=tmp_path / "bases").get(k)
    assert torch.equal(again.tensors["keys"], small.get(k).tensors["keys"])
    with pytest.raises(CapsuleError, match="no capsule basis"):
        CapsuleTier(inner, CapsuleBank()).get(k)
    (tmp_path / "bases" / f"{basis.id}.safetensors").write_bytes(b"garbage")
    with pytest.raises(CorruptEntryError):
        CapsuleTier(inner, CapsuleBank(), basis_dir=tmp_path / "bases").get(k)
    with pytest.raises(TypeError):
        CapsuleTier(small, bank)
    with pytest.raises(TypeError):
        CapsuleTier(inner, "bank")  # type: ignore[arg-type]
