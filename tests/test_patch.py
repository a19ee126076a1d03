"""Conditioning patches: exactness at full rank, orbit/exact agreement, every kind's round trip,
and typed refusals of bad inputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import seeded_ids

from contextdeque import relocate
from contextdeque.eval.arms import ReprefillArm, ReuseRequest
from contextdeque.patch.ops import combine_patches, patch_from_conditioned, truncate_patch
from contextdeque.core.errors import CorruptEntryError, FingerprintMismatchError, PatchError
from contextdeque.patch import PATCH_KINDS, Patch, SharedBasis, form_patch


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def tiny(tiny_backend_factory):
    return tiny_backend_factory("llama", seed=0)


@pytest.fixture(scope="module")
def tiny_chunks(tiny):
    return [tiny.encode(token_ids=seeded_ids(n, s)) for n, s in ((20, 1), (16, 2), (24, 3))]


def _chained_full(backend, chunks):
    """Exact full-rank patches, each formed with its antecedents' own patches applied."""
    pats: dict[int, list[Patch]] = {}
    for i in range(1, len(chunks)):
        pats[i] = [form_patch(backend, chunks[i], [(chunks[j], pats.get(j)) for j in range(i)], rank="full")]
    return pats


def _assembled(backend, chunks, pats):
    out, pos = [], backend.root_len
    for i, c in enumerate(chunks):
        out.append(relocate(c, pos, patch=pats.get(i)))
        pos += c.span
    return out


def _max_rel_err(parts, ref_kv, root_len):
    """max |kv - ref| over the chunk rows, relative to max |ref|."""
    worst, off = 0.0, root_len
    for part in parts:
        T = part[0][0].shape[1]
        for (k, v), (rk, rv) in zip(part, ref_kv):
            for a, b in ((k, rk[:, off:off + T]), (v, rv[:, off:off + T])):
                worst = max(worst, float((a - b).abs().max()) / max(1e-6, float(b.abs().max())))
        off += T
    return worst


def test_full_rank_patch_equals_reprefill_tiny(tiny, tiny_chunks):
    ref = ReprefillArm().run(ReuseRequest(tiny, tiny_chunks))
    pats = _chained_full(tiny, tiny_chunks)
    err = _max_rel_err(_assembled(tiny, tiny_chunks, pats), ref.kv, tiny.root_len)
    blind = _max_rel_err(_assembled(tiny, tiny_chunks, {}), ref.kv, tiny.root_len)
    assert err < 1e-5
    assert blind > 1e-2  # the deficit is real: without the patch the KV differs


def test_full_rank_patch_equals_reprefill_real_model(default_backend):
    be = default_backend
    a = be.encode("The lighthouse keeper on Varn Island was a woman named Odile Marchetti. She kept a log of every ship.")
    b = be.encode("During the storm the keeper rowed out alone and brought two fishermen to the chapel on the hill.")
    ref = ReprefillArm().run(ReuseRequest(be, [a, b]))
    pats = _chained_full(be, [a, b])
    assert pats[1][0].rank_k == min(b.n_tokens, be.layout.k_heads * be.layout.k_dim)
    err = _max_rel_err(_assembled(be, [a, b], pats), ref.kv, be.root_len)
    blind = _max_rel_err(_assembled(be, [a, b], {}), ref.kv, be.root_len)
    assert err < 1e-5
    assert blind > 1e-3


def test_patch_from_conditioned_matches_form_patch(tiny, tiny_chunks):
    req = ReuseRequest(tiny, tiny_chunks)
    ref = ReprefillArm().run(req)
    pats = _chained_full(tiny, tiny_chunks)
    o, c = req.offsets[2], tiny_chunks[2]
    direct = patch_from_conditioned(tiny, c, [(k[:, o:o + c.n_tokens], v[:, o:o + c.n_tokens]) for k, v in ref.kv],
                                    req.starts[2], [x.id for x in tiny_chunks[:2]])
    for l in range(c.num_layers):
        for x, y in zip(direct.layer_delta(l), pats[2][0].layer_delta(l)):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_truncated_full_patch_is_the_rank_m_patch(tiny, tiny_chunks):
    a, b = tiny_chunks[0], tiny_chunks[1]
    full = form_patch(tiny, b, [a], rank="full")
    direct = form_patch(tiny, b, [a], rank=4)
    cut = truncate_patch(full, 4)
    assert (cut.rank_k, cut.rank_v) == (4, 4)
    for l in range(b.num_layers):
        for x, y in zip(cut.layer_delta(l), direct.layer_delta(l)):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)
    with pytest.raises(PatchError):
        truncate_patch(direct, 8)  # a rank-4 patch cannot become rank 8
    assert truncate_patch(full, 10_000) is full  # a full-rank patch already is exact


def test_orbit_of_a_single_ordering_equals_the_exact_patch(tiny, tiny_chunks):
    a, b, c = tiny_chunks
    exact = form_patch(tiny, c, [a, b], rank=6, kind="exact")
    orbit = form_patch(tiny, c, [a, b], rank=6, kind="orbit", orderings=[(0, 1)])
    assert orbit.kind == "orbit" and orbit.antecedent_signature != exact.antecedent_signature
    for l in range(c.num_layers):
        for x, y in zip(orbit.layer_delta(l), exact.layer_delta(l)):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


def test_orbit_kind_is_the_mean_over_orderings(tiny, tiny_chunks):
    a, b, c = tiny_chunks
    orbit = form_patch(tiny, c, [a, b], rank="full", kind="orbit")
    per = [form_patch(tiny, c, ants, rank="full") for ants in ([a, b], [b, a])]
    mean = combine_patches(per, "full")
    for l in range(c.num_layers):
        for x, y in zip(orbit.layer_delta(l), mean.layer_delta(l)):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    # the orbit is not any single ordering's patch
    assert float((orbit.layer_delta(1)[0] - per[0].layer_delta(1)[0]).abs().max()) > 1e-4


def _make(kind: str, tiny, chunks):
    a, b, c = chunks
    if kind == "orbit":
        return form_patch(tiny, c, [a, b], rank=5, kind="orbit"), None
    if kind == "deep":
        return form_patch(tiny, c, [a, b], rank=5, kind="deep", deep_layers=1), None
    if kind == "removal":
        cur = form_patch(tiny, c, [a, b], rank=5)
        return form_patch(tiny, c, [b], rank=5, kind="removal", current=[cur]), None
    if kind == "shared":
        basis = SharedBasis.fit(tiny, [(c, [a, b]), (b, [a])], rank=8)
        return form_patch(tiny, c, [a, b], rank=5, kind="shared", basis=basis), basis
    return form_patch(tiny, c, [a, b], rank=5, kind=kind), None


@pytest.mark.parametrize("kind", sorted(PATCH_KINDS))
def test_each_kind_round_trips_and_applies(kind, tiny, tiny_chunks):
    patch, basis = _make(kind, tiny, tiny_chunks)
    assert patch.kind == kind
    tensors, meta = patch.to_entry()
    assert all(isinstance(v, str) for v in meta.values())
    back = Patch.from_entry(tensors, meta, basis=basis)
    assert back.id == patch.id and back.layers == patch.layers
    assert (back.rank_k, back.rank_v) == (patch.rank_k, patch.rank_v)
    c = tiny_chunks[2]
    start = 40  # any position: the patch lives in the content frame
    kv_a = relocate(c, start, patch=patch)
    kv_b = relocate(c, start, patch=back)
    blind = relocate(c, start)
    for (ka, va), (kb, vb) in zip(kv_a, kv_b):
        torch.testing.assert_close(ka, kb, atol=0, rtol=0)
        torch.testing.assert_close(va, vb, atol=0, rtol=0)
    assert any(float((ka - kc).abs().max()) > 0 for (ka, _), (kc, _) in zip(kv_a, blind))


def test_shared_patch_needs_its_basis(tiny, tiny_chunks):
    patch, basis = _make("shared", tiny, tiny_chunks)
    tensors, meta = patch.to_entry()
    with pytest.raises(PatchError):
        Patch.from_entry(tensors, meta)  # no basis given: the caller's error, not a corrupt file
    bad = dict(meta)
    del bad["rank_k"]
    with pytest.raises(CorruptEntryError):
        Patch.from_entry(tensors, bad, basis=basis)


def test_shared_patch_records_the_rank_it_keeps(tiny, tiny_chunks):
    a, b, c = tiny_chunks
    basis = SharedBasis.fit(tiny, [(c, [a, b])], rank=3)
    p = form_patch(tiny, c, [a, b], rank=8, kind="shared", basis=basis)
    assert p.rank_k == p.k_u.shape[-1] == 3


class _Store:
    def __init__(self, chunks):
        self._c = {c.id: c for c in chunks}

    def get_chunk(self, cid):
        return self._c.get(cid)


def test_bad_inputs_raise_typed_errors(tiny, tiny_chunks, tiny_backend_factory):
    a, b, c = tiny_chunks
    p = form_patch(tiny, b, [a], rank=4)
    with pytest.raises(PatchError):
        relocate(c, 30, patch=p)  # a patch for another chunk
    other_model = dataclasses.replace(p, fingerprint="0" * 32)
    with pytest.raises(FingerprintMismatchError):
        relocate(b, 30, patch=other_model)
    with pytest.raises(PatchError):
        form_patch(tiny, b, [a], rank=min(b.n_tokens, 64) + 1)  # rank > min(T, F)
    with pytest.raises(PatchError):
        form_patch(tiny, b, [a], rank=-2)
    with pytest.raises(PatchError):
        form_patch(tiny, b, ["f" * 32], store=_Store([a]))  # antecedent not in the store
    with pytest.raises(PatchError):
        form_patch(tiny, b, [a.id])  # an id but no store
    assert form_patch(tiny, b, [a.id], rank=2, store=_Store([a])).antecedents == (a.id,)
    with pytest.raises(PatchError):
        form_patch(tiny, b, [a], kind="no-such-kind")
    other = tiny_backend_factory("llama", seed=1)
    foreign = other.encode(token_ids=seeded_ids(12, 9))
    with pytest.raises(FingerprintMismatchError):
        form_patch(tiny, foreign, [a])  # chunk of another model
    with pytest.raises(FingerprintMismatchError):
        form_patch(tiny, b, [foreign])  # antecedent of another model
