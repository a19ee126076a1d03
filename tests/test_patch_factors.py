"""Mixed-precision patch factors (contextdeque.patch.factors) and the allocation of bytes, not only
rank (contextdeque.patch.alloc.allocate_precision): the quantizers against a dense oracle, the
stored bytes against the accounting, safetensors round trips through a disk store, the kernel
path against the dense correction, the greedy allocation against brute force, and the rule on
tiny models of three families (random weights: the mechanics)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import pytest
import torch

from contextdeque.core.errors import CorruptEntryError, PatchError, WindowError
from contextdeque.patch import FidelityRule, fidelity_report, form_patch
from contextdeque.patch.alloc import allocate_precision, allocate_ranks, layer_spectra, precision_tables
from contextdeque.patch.base import Patch
from contextdeque.patch.factors import (
    PRECISIONS, dequantize_rows, direction_cost, direction_errors, quantize_rows, round_trip,
)
from contextdeque.patch.ops import cut_patch, mix_patch, truncate_patch
from helpers import assert_relocates_as_dense

FAMILIES = ("llama", "qwen2", "deepseek_v3")


# ---------------------------------------------------------------------------- quantizers


@pytest.mark.parametrize("precision, levels", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("width", [1, 7, 64, 257])
def test_rows_round_trip_within_half_a_step(precision, levels, width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(5, width, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 0.0])[:, None]
    codes, scales = quantize_rows(x, precision)
    assert codes.dtype == (torch.int8 if precision == "int8" else torch.uint8)
    assert codes.shape == (5, width if precision == "int8" else (width + 1) // 2) and scales.dtype == torch.float32
    back = dequantize_rows(codes, scales, precision, width)
    assert back.shape == x.shape
    group = width if precision == "int8" else 32
    for start in range(0, width, group):  # each group's step is its own absmax over the levels
        part = x[:, start:start + group]
        step = part.abs().amax(1) / levels
        assert bool(((back[:, start:start + group] - part).abs() <= step[:, None] / 2 * (1 + 1e-5) + 1e-12).all())
        idx = part.abs().argmax(1)  # each group's largest value is exact (up to fp32)
        torch.testing.assert_close(back[:, start:start + group][torch.arange(4), idx[:4]], part[torch.arange(4), idx[:4]],
                                   rtol=1e-6, atol=0)
    assert scales.shape == ((5,) if precision == "int8" else (5, -(-width // 32)))
    assert torch.equal(back[4], torch.zeros(width)) and bool((scales[4] == 0).all())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_direction_errors_match_the_dense_reconstruction(precision):
    g = torch.Generator().manual_seed(3)
    u = torch.randn(40, 6, generator=g) * torch.tensor([50.0, 9.0, 3.0, 1.0, 0.2, 0.0])
    w = torch.linalg.qr(torch.randn(24, 6, generator=g))[0].T  # orthonormal rows, as an SVD's
    got = direction_errors(u, w, precision, torch.bfloat16)
    uq = round_trip(u.T, precision, torch.bfloat16).T
    wq = round_trip(w, precision, torch.bfloat16)
    for j in range(6):
        dense = torch.outer(u[:, j].double(), w[j].double()) - torch.outer(uq[:, j].double(), wq[j].double())
        assert float(got[j]) == pytest.approx(float(dense.pow(2).sum()), rel=1e-6, abs=1e-9)
    energy = u.pow(2).sum(0).double()
    rel = got[:5] / energy[:5]
    assert float(got[5]) == 0.0  # a zero direction costs nothing
    # measured, not assumed, but of the expected order: int4 ≫ int8 ≫ bf16 rounding
    bound = {"hi": 1e-4, "bf16": 1e-4, "int8": 1e-3, "int4": 0.2}[precision]
    assert bool((rel < bound).all())


def test_a_direction_costs_exactly_what_it_stores():
    T, F = 37, 24
    assert direction_cost("hi", T, F, 2) == (T + F) * 2 + 1
    assert direction_cost("int8", T, F, 2) == T + F + 8 + 1
    assert direction_cost("bf16", T, F, 4) == (T + F) * 2 + 1
    assert direction_cost("int4", T, F, 2) == 19 + 12 + 4 * (2 + 1) + 1  # one scale per 32 values
    with pytest.raises(PatchError):
        direction_cost("int2", T, F, 2)


# ---------------------------------------------------------------------------- mixed patches


@pytest.fixture(scope="module")
def full_patch(tiny_backend_factory):
    be = tiny_backend_factory("llama")
    a = be.encode(token_ids=list(range(3, 27)))
    b = be.encode(token_ids=list(range(40, 71)))  # an odd token count: int4 pads each u
    return be, a, b, form_patch(be, b, [a], rank="full")


def _plan(full, seed=0):
    """Per layer: K and V precisions of a few leading directions (every precision, rank 0 too)."""
    rk, rv = full.layer_ranks
    g = torch.Generator().manual_seed(seed)
    pk, pv = [], []
    for i in range(len(full.layers)):
        mk = [0, 5, 3][i % 3] if i else 4
        mv = [2, 0, 6][i % 3]
        pk.append([PRECISIONS[int(x)] for x in torch.randint(0, 3, (min(mk, rk[i]),), generator=g)])
        pv.append([PRECISIONS[int(x)] for x in torch.randint(0, 3, (min(mv, rv[i]),), generator=g)])
    return pk, pv


def test_mixed_patch_reads_back_each_direction_at_its_precision(full_patch):
    be, _, b, full = full_patch
    pk, pv = _plan(full)
    mp = mix_patch(full, pk, pv)
    keep = [i for i in range(len(full.layers)) if pk[i] or pv[i]]
    assert mp.layers == tuple(full.layers[i] for i in keep)
    elem = full.k_u.element_size()
    want = 0
    for j, i in enumerate(keep):
        for which, prec in (("k", pk[i]), ("v", pv[i])):
            u, w = full.layer_factors(which, i)
            got_u, got_w = mp.layer_factors(which, j)
            assert got_u.shape == (b.n_tokens, len(prec)) and got_w.shape == (len(prec), w.shape[1])
            for d, p in enumerate(prec):
                torch.testing.assert_close(got_u[:, d], round_trip(u[:, d:d + 1].T, p, full.k_u.dtype)[0], rtol=0, atol=0)
                torch.testing.assert_close(got_w[d], round_trip(w[d:d + 1], p, full.k_u.dtype)[0], rtol=0, atol=0)
                want += direction_cost(p, b.n_tokens, w.shape[1], elem)
    # the byte accounting is exact: what the allocation counts is what the entry stores
    tensors, _ = mp.to_entry()
    assert mp.nbytes == want == sum(t.numel() * t.element_size() for t in tensors.values())
    assert "(" in mp.rank_label and mp.per_layer


def test_mixed_patch_round_trips_through_a_disk_store_and_refuses_forgeries(full_patch, tmp_path):
    from contextdeque.stores import DiskTier, StoreEntry, TieredStore

    _, _, b, full = full_patch
    mp = mix_patch(full, *_plan(full, seed=1))
    tensors, meta = mp.to_entry()
    store = TieredStore([DiskTier(tmp_path, None)])
    store.put("patch/x", StoreEntry(tensors, meta))
    files = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert files and not any(".tmp" in f for f in files)  # written atomically: no temporary left
    entry = store.get("patch/x", expect_fingerprint=b.fingerprint)
    back = Patch.from_entry(dict(entry.tensors), dict(entry.meta))
    assert back.id == mp.id and back.nbytes == mp.nbytes and back.layer_ranks == mp.layer_ranks
    for l in mp.layers:
        for x, y in zip(back.layer_delta(l), mp.layer_delta(l)):
            assert torch.equal(x, y)
    # the precisions are part of the identity: the same ranks stored plain are another patch
    assert mp.id != cut_patch(full, *[[len(p) for p in ps] for ps in _plan(full, seed=1)]).id
    code = tensors["q_k_code"].clone()
    code[0] = 3  # no such precision
    for forged_t, forged_m in ((dict(tensors, q_k_code=code), meta),
                               ({k: v for k, v in tensors.items() if k != "q_v_w_int8_scale"}, meta),
                               (dict(tensors, q_k_u_int4=tensors["q_k_u_int4"][:, :-1]), meta),
                               (tensors, dict(meta, ranks_k=json.dumps([9] * len(mp.layers)))),
                               (tensors, dict(meta, n_tokens=str(b.n_tokens + 1)))):
        with pytest.raises(CorruptEntryError):
            Patch.from_entry(forged_t, forged_m)


def test_cutting_a_mixed_patch_keeps_its_precisions(full_patch):
    _, _, _, full = full_patch
    pk, pv = _plan(full, seed=2)
    mp = mix_patch(full, pk, pv)
    rk, rv = mp.layer_ranks
    cut = cut_patch(mp, [max(0, r - 1) for r in rk], list(rv))
    assert cut.mixed is not None and cut.nbytes < mp.nbytes
    at = {l: i for i, l in enumerate(cut.layers)}
    for i, l in enumerate(mp.layers):
        if l not in at:
            assert rk[i] <= 1 and rv[i] == 0
            continue
        for which in ("k", "v"):
            u, w = mp.layer_factors(which, i)
            cu, cw = cut.layer_factors(which, at[l])
            m = cu.shape[1]
            assert torch.equal(cu, u[:, :m]) and torch.equal(cw, w[:m])
            assert cut.mixed.precisions(which, at[l]) == mp.mixed.precisions(which, i)[:m]
    with pytest.raises(PatchError):
        mix_patch(mp, pk, pv)  # already mixed


def test_mixed_patch_through_the_kernel_equals_the_dense_correction(full_patch):
    """relocate() with a mixed patch against the oracle: the content plus each layer's dense fp32
    Δ of the dequantized factors, relocated without a patch."""
    be, _, b, full = full_patch
    mp = mix_patch(full, *_plan(full, seed=3))
    assert_relocates_as_dense(be, b, mp)


# ---------------------------------------------------------------------------- the allocation


def _tables(s2: torch.Tensor, rel: dict[str, float]) -> dict[str, torch.Tensor]:
    return {p: s2 * r for p, r in rel.items()}


REL = {"hi": 0.0, "int8": 1e-4, "int4": 0.05}
COSTS = {"hi": 40, "int8": 21, "int4": 11}


def _energy(s2k, s2v, pk, pv, rel=REL):
    def frac(s2, plan):
        tot = float(s2.sum())
        got = sum(float(s2[l, j]) * (1 - rel[p]) for l, row in enumerate(plan) for j, p in enumerate(row))
        return 1.0 if tot <= 0 else got / tot

    return 0.5 * (frac(s2k, pk) + frac(s2v, pv))


def _plans(L, r):
    rows = [tuple(x) for m in range(r + 1) for x in itertools.product(tuple(COSTS), repeat=m)]
    return itertools.product(rows, repeat=L)


def test_the_greedy_allocation_of_bytes_is_near_the_brute_force_optimum():
    """Two layers, two directions each, three precisions (every plan: brute force): under a byte
    cap B the allocation captures at least the best any plan of B minus one direction's bytes
    does, and a target is met within one direction's bytes of the fewest possible."""
    g = torch.Generator().manual_seed(0)
    for trial in range(3):
        s2k = torch.rand(2, 2, generator=g, dtype=torch.float64).pow(2).sort(1, descending=True).values
        s2v = torch.rand(2, 2, generator=g, dtype=torch.float64).pow(2).sort(1, descending=True).values
        kw = dict(costs_k=COSTS, costs_v=COSTS, errors_k=_tables(s2k, REL), errors_v=_tables(s2v, REL))

        def cost(plan):
            return sum(COSTS[p] for row in plan for p in row)

        table = [(cost(pk) + cost(pv), _energy(s2k, s2v, pk, pv)) for pk in _plans(2, 2) for pv in _plans(2, 2)]
        for budget in range(0, 4 * 40 + 1, 7):
            got = allocate_precision(s2k, s2v, budget=budget, **kw)
            assert got.nbytes <= budget
            assert got.nbytes == cost(got.precisions_k) + cost(got.precisions_v)
            assert got.energy == pytest.approx(_energy(s2k, s2v, got.precisions_k, got.precisions_v), abs=1e-12)
            assert got.energy >= max((e for b, e in table if b <= budget - 40), default=0.0) - 1e-12
        for target in (0.3, 0.7, 0.9, 0.99):
            got = allocate_precision(s2k, s2v, target=target, **kw)
            fewest = min(b for b, e in table if e >= target - 1e-12)
            assert got.energy >= target - 1e-12 and got.nbytes <= fewest + 40


def test_precision_goes_where_the_energy_is():
    """A constructed case: layer 0's Δ is one strong direction, layer 1's a flat tail of many weak
    ones. Under a budget too small for everything at full precision, the strong direction keeps
    the most precise storage and the tail is stored coarsely rather than dropped; with one
    precision at zero error, the allocation is allocate_ranks'."""
    r = 16
    s2 = torch.zeros(2, r, dtype=torch.float64)
    s2[0, 0] = 100.0
    s2[0, 1:] = 1e-6
    s2[1, :] = 1.0
    kw = dict(costs_k=COSTS, costs_v=COSTS, errors_k=_tables(s2, REL), errors_v=_tables(s2, REL))
    got = allocate_precision(s2, s2, budget=2 * (21 + 16 * 11), kv_share=None, **kw)
    for plan in (got.precisions_k, got.precisions_v):
        assert plan[0] == ("int8",)  # the strong direction finely; layer 0's weak ones not at all
        assert plan[1] == ("int4",) * r  # every tail direction, coarsely, rather than 7 at full precision
    rich = allocate_precision(s2, s2, target=0.9999999, kv_share=None, **kw)
    assert rich.precisions_k[0][0] == "hi"  # at the leading direction the last error is worth its bytes
    plain = allocate_precision(s2, s2, costs_k={"hi": 40}, costs_v={"hi": 40}, errors_k={"hi": 0 * s2},
                               errors_v={"hi": 0 * s2}, budget=400)
    ranks = allocate_ranks(s2, s2, bytes_k=40, bytes_v=40, budget=400)
    assert (plain.ranks_k, plain.ranks_v, plain.nbytes) == (ranks.ranks_k, ranks.ranks_v, ranks.nbytes)
    assert plain.energy == pytest.approx(ranks.energy, abs=1e-12)
    with pytest.raises(PatchError):
        allocate_precision(s2, s2, **kw)  # neither a target nor a budget
    with pytest.raises(PatchError):
        allocate_precision(s2, s2, costs_k=COSTS, costs_v=COSTS, errors_k={"hi": s2}, errors_v=_tables(s2, REL), target=0.5)
    with pytest.raises(PatchError):
        FidelityRule(energy=0.9, precisions=("hi", "fp8"))


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_mixed_rule_on_three_families(tiny_backend_factory, one_thread, arch):
    """The rule with every precision on tiny models of three families (different K / V widths):
    its energy accounting matches the residual of the dequantized factors (an oracle independent
    of the allocation), it stays within the cap or reports the miss, its bytes are what the
    allocation counted, it survives serialization, and it fits the same energy in fewer bytes
    than the plain rule."""
    from contextdeque.eval.fidelity.envelope import captured

    be = tiny_backend_factory(arch)
    a = be.encode(token_ids=list(range(3, 29)))
    b = be.encode(token_ids=list(range(40, 73)))
    full = form_patch(be, b, [a], rank="full")
    mixed = FidelityRule(energy=0.9, precisions=PRECISIONS)
    mp = mixed.shape(full, b)
    rep = fidelity_report(mp)
    assert rep["bytes"] == mp.nbytes and not rep["miss"] and sum(rep["precisions"].values()) > 0
    assert captured(full, mp, b) == pytest.approx(rep["energy"], abs=2e-3)
    plain = FidelityRule(energy=0.9).shape(full, b)
    assert mp.nbytes < plain.nbytes
    back = Patch.from_entry(*mp.to_entry())
    assert back.id == mp.id and back.nbytes == mp.nbytes
    assert mixed.key_parts() != FidelityRule(energy=0.9).key_parts()  # another store entry
    tight = dataclasses.replace(mixed, energy=0.999, max_patch_fraction=0.005)
    cut = tight.shape(full, b)
    rep = fidelity_report(cut)
    assert rep["miss"] and rep["action"] == "reported" and cut.nbytes <= rep["budget_bytes"]
    over = dataclasses.replace(tight, on_miss="exceed_budget").shape(full, b)
    assert not fidelity_report(over)["miss"] and over.nbytes > rep["budget_bytes"]
    exact = dataclasses.replace(tight, on_miss="recompute").shape(full, b)
    assert exact.mixed is None and exact.layer_ranks == full.layer_ranks
    ck, cv, ek, ev = precision_tables(full, PRECISIONS)
    s2k, _ = layer_spectra(full)
    assert ek["int4"].shape == s2k.shape and bool((ek["int4"] >= ek["int8"] - 1e-12).all())
    assert ck["int4"] < ck["int8"] < ck["hi"]
    assert truncate_patch(full, 2).nbytes > 0


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_window_allocates_bytes_under_its_target(tiny_backend_factory, one_thread, arch, tmp_path):
    """ContextWindow(patch_precisions=...) on three families: the patches it forms under a
    fidelity target are mixed-precision, within the byte cap or reported as misses, and a saved
    and reopened window keeps the setting and serves the same patches (the same ids: the
    precisions are part of them)."""
    import contextdeque as cd
    from helpers import seeded_ids

    be = tiny_backend_factory(arch)
    w = cd.ContextWindow(be, patch_policy="eager", fidelity_target=0.99, max_patch_fraction=0.05,
                         patch_precisions=PRECISIONS)
    for n, s in ((20, 1), (26, 2), (30, 3)):
        w.append(token_ids=seeded_ids(n, s, 200))
    patched = [r for r in w.refs if w.patches(r)]
    assert len(patched) == 2
    for r in patched:
        (p,) = w.patches(r)
        rep = fidelity_report(p)
        assert p.mixed is not None and rep["precisions"] is not None
        assert p.nbytes == rep["bytes"] <= rep["budget_bytes"] == int(0.05 * w.chunk(r).nbytes)
        assert rep["miss"] == (rep["energy"] < rep["energy_target"] - 1e-9)
    w.save(tmp_path / "w.cdq")
    opened = cd.ContextWindow.open(tmp_path / "w.cdq", be)
    assert opened._ctx.config.patch_precisions == PRECISIONS
    assert [p.id for r in opened.refs for p in opened.patches(r)] == [p.id for r in w.refs for p in w.patches(r)]
    with pytest.raises(WindowError):
        cd.ContextWindow(be, fidelity_target=0.99, patch_precisions=("hi", "fp8"))


def test_the_command_line_names_the_precisions():
    """``--patch-precisions`` (serve, replay, fidelity) reaches the window's settings; an unknown
    precision is a usage error."""
    import argparse

    from contextdeque.cli.window_options import add_fidelity_target_arguments, window_config

    parser = argparse.ArgumentParser()
    add_fidelity_target_arguments(parser, "target")
    cfg = window_config(parser.parse_args(["--fidelity-target", "0.99", "--patch-precisions", "hi,bf16,int8,int4"]))
    assert cfg.patch_precisions == PRECISIONS and cfg.fidelity_target == 0.99
    assert window_config(parser.parse_args(["--fidelity-target", "0.99"])).patch_precisions == PRECISIONS  # the default
    rank_only = window_config(parser.parse_args(["--fidelity-target", "0.99", "--patch-precisions", "hi"]))
    assert rank_only.patch_precisions == ("hi",)
    with pytest.raises(SystemExit):
        parser.parse_args(["--patch-precisions", "int3"])
