"""Rank allocation under one byte budget (contextdeque.patch.alloc) and per-layer-rank patches:
the greedy allocation against brute force, its energy accounting against the SVD, and per-layer
ranks (rank 0 included) through cutting, serialization, the store and the kernels."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

from contextdeque.core.errors import CorruptEntryError, PatchError
from contextdeque.patch import FidelityRule, allocate_ranks, fidelity_report, form_patch
from contextdeque.patch.alloc import direction_bytes, layer_spectra, relative_weights
from contextdeque.patch.base import Patch
from contextdeque.patch.ops import cut_patch, truncate_patch
from helpers import assert_relocates_as_dense


def spectra(seed: int, L: int, r: int, zero_layer: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s2 = torch.rand(L, r, generator=g, dtype=torch.float64).pow(3) * torch.rand(L, 1, generator=g, dtype=torch.float64) * 10
    s2 = s2.sort(dim=1, descending=True).values
    if zero_layer is not None:
        s2[zero_layer] = 0.0
    return s2


def energy_of(s2k, s2v, rk, rv) -> float:
    def frac(s2, r):
        tot = float(s2.sum())
        return 1.0 if tot <= 0 else sum(float(s2[l, :m].sum()) for l, m in enumerate(r)) / tot

    return 0.5 * (frac(s2k, rk) + frac(s2v, rv))


def all_allocations(L: int, r: int):
    per = list(itertools.product(range(r + 1), repeat=L))
    return itertools.product(per, per)


@pytest.mark.parametrize("seed", range(6))
def test_equal_costs_reach_a_target_with_the_fewest_bytes(seed):
    L, r, cost = 3, 3, 7
    s2k, s2v = spectra(seed, L, r), spectra(100 + seed, L, r)
    for target in (0.3, 0.6, 0.8, 0.95, 0.999):
        got = allocate_ranks(s2k, s2v, bytes_k=cost, bytes_v=cost, target=target)
        assert got.energy >= target - 1e-12
        assert got.energy == pytest.approx(energy_of(s2k, s2v, got.ranks_k, got.ranks_v), abs=1e-12)
        best = min(cost * (sum(rk) + sum(rv)) for rk, rv in all_allocations(L, r)
                   if energy_of(s2k, s2v, rk, rv) >= target - 1e-12)
        assert got.nbytes == best


@pytest.mark.parametrize("seed", range(6))
def test_unequal_costs_the_greedy_allocation_is_within_one_direction_of_optimal(seed):
    """K and V directions of different widths cost differently (a knapsack): under a byte cap B the
    allocation captures at least the best any allocation of B minus one direction's bytes does
    (brute force), and a target is met within one direction's bytes of the fewest possible."""
    L, r, bk, bv = 2, 3, 5, 11
    s2k, s2v = spectra(seed, L, r), spectra(50 + seed, L, r)
    table = [(bk * sum(rk) + bv * sum(rv), energy_of(s2k, s2v, rk, rv)) for rk, rv in all_allocations(L, r)]
    for budget in range(0, bk * L * r + bv * L * r + 1, 3):
        got = allocate_ranks(s2k, s2v, bytes_k=bk, bytes_v=bv, budget=budget)
        assert got.nbytes <= budget
        assert got.energy >= max((e for b, e in table if b <= budget - max(bk, bv)), default=0.0) - 1e-12
    for target in (0.4, 0.7, 0.9, 0.99):
        got = allocate_ranks(s2k, s2v, bytes_k=bk, bytes_v=bv, target=target)
        fewest = min(b for b, e in table if e >= target - 1e-12)
        assert got.energy >= target - 1e-12 and got.nbytes <= fewest + max(bk, bv)


@pytest.mark.parametrize("seed", range(4))
def test_equal_costs_capture_the_most_energy_under_a_cap(seed):
    L, r, cost = 3, 3, 4
    s2k, s2v = spectra(seed, L, r), spectra(20 + seed, L, r)
    table = [(cost * (sum(rk) + sum(rv)), energy_of(s2k, s2v, rk, rv)) for rk, rv in all_allocations(L, r)]
    for budget in range(0, cost * 2 * L * r + 1, 3):
        got = allocate_ranks(s2k, s2v, bytes_k=cost, bytes_v=cost, budget=budget)
        assert got.nbytes <= budget
        assert got.energy == pytest.approx(max(e for b, e in table if b <= budget), abs=1e-12)


def test_a_layer_without_deficit_gets_rank_zero_and_a_zero_delta_needs_nothing():
    s2k, s2v = spectra(1, 4, 5, zero_layer=2), spectra(2, 4, 5, zero_layer=2)
    got = allocate_ranks(s2k, s2v, bytes_k=3, bytes_v=3, target=0.999999)
    assert got.ranks_k[2] == 0 and got.ranks_v[2] == 0 and got.energy >= 0.999999 - 1e-12
    zero = torch.zeros(3, 4, dtype=torch.float64)
    none = allocate_ranks(zero, zero, bytes_k=3, bytes_v=3, target=0.9)
    assert none.ranks_k == none.ranks_v == (0, 0, 0) and none.energy == 1.0 and none.nbytes == 0
    half = allocate_ranks(zero, s2v[:3], bytes_k=3, bytes_v=3, target=0.9)  # zero Δ_K: V alone carries it
    assert sum(half.ranks_k) == 0 and half.energy_k == 1.0 and half.energy >= 0.9


def test_layer_weights_and_pooled_kv_are_a_rescaling_of_the_spectra():
    """Weights multiply each layer's energies (the same allocation as on pre-weighted spectra);
    ``kv_share=None`` pools K and V: each tensor's share is its part of the total energy."""
    s2k, s2v = spectra(5, 3, 4), spectra(6, 3, 4)
    wk = torch.tensor([0.1, 1.0, 5.0], dtype=torch.float64)
    wv = torch.tensor([2.0, 0.0, 1.0], dtype=torch.float64)
    got = allocate_ranks(s2k, s2v, bytes_k=3, bytes_v=5, target=0.9, weight_k=wk, weight_v=wv)
    same = allocate_ranks(s2k * wk[:, None], s2v * wv[:, None], bytes_k=3, bytes_v=5, target=0.9)
    assert got == same and got.ranks_v[1] == 0  # a zero-weight layer gets nothing
    pooled = allocate_ranks(s2k, s2v, bytes_k=3, bytes_v=3, target=0.8, kv_share=None)
    share = float(s2k.sum() / (s2k.sum() + s2v.sum()))
    assert pooled.k_share == pytest.approx(share)
    kept = sum(float(s2k[l, :m].sum()) for l, m in enumerate(pooled.ranks_k)) + \
        sum(float(s2v[l, :m].sum()) for l, m in enumerate(pooled.ranks_v))
    assert pooled.energy == pytest.approx(kept / float(s2k.sum() + s2v.sum()), abs=1e-12) and pooled.energy >= 0.8
    with pytest.raises(PatchError):
        allocate_ranks(s2k, s2v, bytes_k=1, bytes_v=1, target=0.5, weight_k=-wk)


def test_budget_binds_and_bad_input_is_refused():
    s2k, s2v = spectra(3, 3, 4), spectra(4, 3, 4)
    capped = allocate_ranks(s2k, s2v, bytes_k=10, bytes_v=10, target=0.999, budget=35)
    assert capped.nbytes <= 35 and sum(capped.ranks_k) + sum(capped.ranks_v) == 3 and capped.energy < 0.999
    with pytest.raises(PatchError):
        allocate_ranks(s2k, s2v, bytes_k=1, bytes_v=1)
    with pytest.raises(PatchError):
        allocate_ranks(s2k, s2v, bytes_k=1, bytes_v=1, target=1.5)
    with pytest.raises(PatchError):
        allocate_ranks(s2k, s2v[:2], bytes_k=1, bytes_v=1, target=0.5)


def test_energy_accounting_matches_the_svd_reconstruction():
    """The allocation's captured fractions are what truncating each layer's SVD keeps:
    1 - ‖Δ - Δ_m‖² / ‖Δ‖², pooled over layers, for K and V."""
    g = torch.Generator().manual_seed(7)
    L, T, Fk, Fv = 3, 20, 12, 16
    dk = torch.randn(L, T, Fk, generator=g, dtype=torch.float64) * torch.tensor([0.1, 1.0, 3.0], dtype=torch.float64).view(L, 1, 1)
    dv = torch.randn(L, T, Fv, generator=g, dtype=torch.float64)
    s2k, s2v = torch.linalg.svdvals(dk).pow(2), torch.linalg.svdvals(dv).pow(2)
    got = allocate_ranks(s2k, s2v, bytes_k=direction_bytes(T, Fk, 4), bytes_v=direction_bytes(T, Fv, 4), target=0.8)

    def kept(d, ranks):
        err = 0.0
        for l, m in enumerate(ranks):
            U, S, Vh = torch.linalg.svd(d[l], full_matrices=False)
            err += float((d[l] - (U[:, :m] * S[:m]) @ Vh[:m]).pow(2).sum())
        return 1.0 - err / float(d.pow(2).sum())

    assert got.energy_k == pytest.approx(kept(dk, got.ranks_k), abs=1e-9)
    assert got.energy_v == pytest.approx(kept(dv, got.ranks_v), abs=1e-9)
    assert got.ranks_k[0] <= got.ranks_k[2]  # the energy lives in the deep (scaled-up) layer


# ---------------------------------------------------------------------------- per-layer patches


@pytest.fixture(scope="module")
def full_patch(tiny_backend_factory):
    be = tiny_backend_factory("llama")
    a = be.encode(token_ids=list(range(3, 27)))
    b = be.encode(token_ids=list(range(40, 70)))
    return be, a, b, form_patch(be, b, [a], rank="full")


def test_cut_patch_keeps_each_layers_top_directions(full_patch):
    be, a, b, full = full_patch
    L = len(full.layers)
    rk = [min(2 + l, full.rank_k) for l in range(L)]
    rv = [0] + [1] * (L - 1)  # layer 0 V: rank 0
    cut = cut_patch(full, rk, rv)
    assert cut.per_layer and cut.layer_ranks == (tuple(rk), tuple(rv))
    assert cut.rank_k == max(rk) and cut.rank_v == 1
    for i, l in enumerate(cut.layers):
        for which, m in (("k", rk[i]), ("v", rv[i])):
            u, w = full.layer_factors(which, i)
            cu, cw = cut.layer_factors(which, i)
            assert cu.is_contiguous() and cw.is_contiguous()
            assert torch.equal(cu, u[:, :m]) and torch.equal(cw, w[:m])
    esize = full.k_u.element_size()
    F = be.layout.k_heads * be.layout.k_dim
    assert cut.nbytes == esize * ((b.n_tokens + F) * sum(rk) + (b.n_tokens + be.layout.v_heads * be.layout.v_dim) * sum(rv))
    # both ranks 0 on a layer: the layer is dropped (layer-sparse)
    sparse = cut_patch(full, [0] + rk[1:], [0] + rv[1:])
    assert sparse.layers == full.layers[1:] and sparse.layer_delta(full.layers[0]) == (None, None)
    # equal ranks on every kept layer: the stacked form again
    uni = cut_patch(full, [3] * L, [3] * L)
    assert not uni.per_layer and uni.k_u.shape == (L, b.n_tokens, 3)
    assert uni.id == truncate_patch(full, 3).id
    with pytest.raises(PatchError):
        cut_patch(full, [full.rank_k + 1] * L, rv)
    with pytest.raises(PatchError):
        cut_patch(full, rk[:-1], rv)


def test_per_layer_patch_survives_serialization_and_refuses_a_forged_entry(full_patch):
    _, _, _, full = full_patch
    L = len(full.layers)
    cut = cut_patch(full, [1, 4, 2][:L] + [2] * (L - 3), [5, 0, 3][:L] + [1] * (L - 3))
    tensors, meta = cut.to_entry()
    back = Patch.from_entry(tensors, meta)
    assert back.id == cut.id and back.layer_ranks == cut.layer_ranks and back.nbytes == cut.nbytes
    for l in cut.layers:
        for x, y in zip(back.layer_delta(l), cut.layer_delta(l)):
            assert torch.equal(x, y)
    assert cut.id != truncate_patch(full, 4, 5).id  # the per-layer ranks are part of the identity
    forged = dict(meta, ranks_k=json.dumps([2] * L))
    with pytest.raises(CorruptEntryError):
        Patch.from_entry(tensors, forged)
    with pytest.raises(CorruptEntryError):
        Patch.from_entry(dict(tensors, k_u=tensors["k_u"][:-1]), meta)


def test_per_layer_patch_through_the_kernel_equals_the_dense_correction(full_patch):
    """relocate() with a per-layer-rank patch (rank 0 on some layers' K or V) against the oracle:
    the content plus each layer's dense fp32 Δ, relocated without a patch."""
    be, _, b, full = full_patch
    L = len(full.layers)
    cut = cut_patch(full, [0] + [3] * (L - 1), [2] + [0] * (L - 2) + [4])
    assert_relocates_as_dense(be, b, cut)


def test_rule_records_its_decision_and_honours_on_miss(full_patch):
    _, _, b, full = full_patch
    page = b.nbytes
    tight = FidelityRule(energy=0.999, max_patch_fraction=0.01)
    reported = tight.shape(full, b)
    rep = fidelity_report(reported)
    assert rep["shortfall"] and rep["miss"] and rep["action"] == "reported"
    assert reported.nbytes <= rep["budget_bytes"] == int(0.01 * page) and rep["energy"] < 0.999
    over = dataclasses.replace(tight, on_miss="exceed_budget").shape(full, b)
    rep = fidelity_report(over)
    assert rep["action"] == "exceeded-budget" and not rep["miss"] and rep["energy"] >= 0.999 - 1e-9
    assert over.nbytes > rep["budget_bytes"]
    exact = dataclasses.replace(tight, on_miss="recompute").shape(full, b)
    assert fidelity_report(exact)["action"] == "recomputed" and exact.layer_ranks == full.layer_ranks
    roomy = FidelityRule(energy=0.5, max_patch_fraction=1.0).shape(full, b)
    rep = fidelity_report(roomy)
    assert rep["action"] == "within-budget" and not rep["shortfall"] and rep["energy"] >= 0.5
    s2k, s2v = layer_spectra(full)
    wk, wv = relative_weights(b, full.layers)  # the rule counts each layer's deficit relative to its KV
    s2k, s2v = s2k * wk[:, None], s2v * wv[:, None]
    kept = {l: i for i, l in enumerate(roomy.layers)}
    rk = [roomy.layer_ranks[0][kept[l]] if l in kept else 0 for l in full.layers]
    rv = [roomy.layer_ranks[1][kept[l]] if l in kept else 0 for l in full.layers]
    assert rep["energy"] == pytest.approx(energy_of(s2k, s2v, rk, rv), abs=1e-6)
    with pytest.raises(PatchError):
        FidelityRule(energy=0.9, on_miss="ignore")


def test_weighted_water_filling_favours_the_more_sensitive_layer():
    """Two layers with the same spectra: equal weights split the bytes evenly; a measured
    sensitivity 4x higher on layer 1 sends every contested direction there first (its weighted
    energy per byte is higher), and the allocation's pooled fraction is the sensitivity-weighted
    one."""
    from contextdeque.patch.alloc import LayerSensitivity

    row = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5], dtype=torch.float64)
    s2 = torch.stack([row, row])
    even = allocate_ranks(s2, s2, bytes_k=5, bytes_v=5, budget=40)
    assert even.ranks_k == even.ranks_v == (2, 2)
    sens = LayerSensitivity(k=(0.4, 1.6), v=(0.4, 1.6))
    wk, wv = sens.for_layers((0, 1))
    got = allocate_ranks(s2, s2, bytes_k=5, bytes_v=5, budget=40, weight_k=wk, weight_v=wv, kv_share=None)
    # layer 1's directions weigh 4x layer 0's: it takes its top two before layer 0's first
    assert got.ranks_k == got.ranks_v == (1, 3)
    assert sum(got.ranks_k) + sum(got.ranks_v) == 8
    weighted_total = float((s2 * wk[:, None]).sum() + (s2 * wv[:, None]).sum())

    def kept(a):
        return (sum(float(s2[l, :m].sum() * wk[l]) for l, m in enumerate(a.ranks_k))
                + sum(float(s2[l, :m].sum() * wv[l]) for l, m in enumerate(a.ranks_v))) / weighted_total

    assert got.energy == pytest.approx(kept(got), abs=1e-12)
    assert kept(got) > kept(even)  # under the measured weights, the same bytes close more


def test_rule_with_sensitivity_moves_rank_to_the_sensitive_layer(tiny_backend_factory):
    """Through :class:`FidelityRule.shape`: the same cap, one layer's K and V sensitivity raised
    tenfold — that layer's ranks grow, the others' do not, and the record says which weights
    were used; a sensitivity that does not cover the patch's layers, or is negative, is refused."""
    from contextdeque.patch.alloc import LayerSensitivity

    be = tiny_backend_factory("llama", num_hidden_layers=4)  # three layers with a deficit (layer 0 has none)
    a = be.encode(token_ids=list(range(3, 27)))
    b = be.encode(token_ids=list(range(40, 70)))
    full = form_patch(be, b, [a], rank="full")
    L = be.layout.num_layers
    flat = LayerSensitivity(k=(1.0,) * L, v=(1.0,) * L)
    cap = 0.1

    def ranks(sens):
        p = FidelityRule(energy=0.999, max_patch_fraction=cap, sensitivity=sens).shape(full, b)
        got = {l: (p.layer_ranks[0][i], p.layer_ranks[1][i]) for i, l in enumerate(p.layers)}
        return p, [got.get(l, (0, 0)) for l in full.layers]

    p_flat, r_flat = ranks(flat)
    s2k, s2v = layer_spectra(full)
    e = s2k.sum(1) + s2v.sum(1)
    live = [j for j in range(len(full.layers)) if float(e[j]) > 1e-6 * float(e.max())]  # layer 0: no Δ
    i = min(live, key=lambda j: sum(r_flat[j]))  # the live layer flat weights give least
    hot = full.layers[i]
    assert sum(r_flat[i]) < full.layer_ranks[0][i] + full.layer_ranks[1][i]
    sharp = LayerSensitivity(k=tuple(10.0 if l == hot else 1.0 for l in range(L)),
                             v=tuple(10.0 if l == hot else 1.0 for l in range(L)))
    p_sharp, r_sharp = ranks(sharp)
    assert sum(r_sharp[i]) > sum(r_flat[i])
    assert all(sum(r_sharp[j]) <= sum(r_flat[j]) for j in range(len(full.layers)) if j != i)
    assert fidelity_report(p_sharp)["weights"] == "sensitivity" and fidelity_report(p_flat)["weights"] == "sensitivity"
    assert FidelityRule(energy=0.9).key_parts() != FidelityRule(energy=0.9, sensitivity=sharp).key_parts()
    assert fidelity_report(FidelityRule(energy=0.9).shape(full, b))["weights"] == "equal"
    with pytest.raises(PatchError):
        FidelityRule(energy=0.9, sensitivity=LayerSensitivity(k=(1.0,), v=(1.0,))).shape(full, b)
    with pytest.raises(PatchError):
        LayerSensitivity(k=(1.0, -1.0), v=(1.0, 1.0))
    with pytest.raises(PatchError):
        LayerSensitivity(k=(1.0, float("nan")), v=(1.0, 1.0))
