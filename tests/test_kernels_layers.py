"""The many-layer entry point (``fused_apply_layers``): per-layer equality, mixed layouts, paged
destinations, one native call for all layers, its counts."""

from __future__ import annotations

import pytest
import torch

from contextdeque.core.errors import KernelArgumentError
from contextdeque.kernels import (
    ContiguousDest,
    PagedDest,
    RopeSpec,
    fused_apply,
    fused_apply_layers,
    slot_mapping_from_block_table,
)
from contextdeque.kernels import native
from kernel_oracle import (
    CPU_BACKENDS,
    assert_ulp_close,
    check_against_oracle,
    oracle,
    rope_tables,
)


# -- the many-layer entry point

def _layers_case(L=4, H=2, T=30, d=64, m=8, dtype=torch.bfloat16):
    rope = RopeSpec("k", 0, d)
    g = torch.Generator().manual_seed(20)
    k = torch.randn(L, H, T, d, generator=g).to(dtype)
    v = torch.randn(L, H, T, d, generator=g).to(dtype)
    kf = (torch.randn(L, T, m, generator=g).to(dtype), (0.3 * torch.randn(L, m, H * d, generator=g)).to(dtype))
    vf = (torch.randn(L, T, m, generator=g).to(dtype), (0.3 * torch.randn(L, m, H * d, generator=g)).to(dtype))
    cos, sin = rope_tables(torch.arange(T) + 3, d)
    return rope, k, v, kf, vf, cos, sin

def _dests(L, H, T, d, dtype, T_total=None, start=0):
    T_total = T_total or T
    g = torch.Generator().manual_seed(21)
    return [
        ContiguousDest(torch.randn(2, H, T_total, d, generator=g).to(dtype), torch.randn(2, H, T_total, d, generator=g).to(dtype), 1, start)
        for _ in range(L)
    ]

@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fused_apply_layers_matches_per_layer(backend):
    """Stacked inputs, sequences, per-layer tables and deep-only factors all give what per-layer calls give."""
    L, H, T, d = 4, 2, 30, 64
    rope, k, v, kf, vf, cos, sin = _layers_case(L, H, T, d)
    per_layer_kf = [(kf[0][i], kf[1][i]) if i % 2 == 0 else None for i in range(L)]  # deep-only style
    cos_l = torch.stack([cos * (1 - 0.01 * i) for i in range(L)])  # per-layer tables (stacked)
    sin_l = torch.stack([sin * (1 + 0.01 * i) for i in range(L)])
    variants = {
        "stacked": (k, v, cos, sin, kf, vf),
        "sequences": (list(k), list(v), cos, sin, [(kf[0][i], kf[1][i]) for i in range(L)], None),
        "per_layer_tables": (k, list(v), cos_l, list(sin_l), kf, vf),
        "deep_only": (list(k), v, cos, sin, per_layer_kf, vf),
    }
    for name, (ks, vs, cs, sn, kfs, vfs) in variants.items():
        dests = _dests(L, H, T, d, torch.bfloat16, T_total=40, start=6)
        before = [(dd.k.clone(), dd.v.clone()) for dd in dests]
        assert fused_apply_layers(ks, vs, rope, cs, sn, kfs, vfs, dests, backend=backend) is None
        new = fused_apply_layers(ks, vs, rope, cs, sn, kfs, vfs, backend=backend)
        for i in range(L):
            lk, lv = ks[i], vs[i]
            lc = cs[i] if (isinstance(cs, list) or cs.dim() == 3) else cs
            ls = sn[i] if (isinstance(sn, list) or sn.dim() == 3) else sn
            lkf = kfs[i] if isinstance(kfs, list) else (None if kfs is None else (kfs[0][i], kfs[1][i]))
            lvf = vfs[i] if isinstance(vfs, list) else (None if vfs is None else (vfs[0][i], vfs[1][i]))
            one = fused_apply(lk, lv, rope, lc, ls, lkf, lvf, backend=backend)
            assert torch.equal(dests[i].k[1, :, 6:36], one[0]) and torch.equal(dests[i].v[1, :, 6:36], one[1]), (name, i)
            assert torch.equal(new[i][0], one[0]) and torch.equal(new[i][1], one[1]), (name, i)
            check_against_oracle(one[0], one[1], lk, lv, rope, lc, ls, lkf, lvf, what=f"{name} layer {i}")
            keep = torch.ones_like(dests[i].k, dtype=torch.bool)
            keep[1, :, 6:36] = False
            assert torch.equal(dests[i].k[keep], before[i][0][keep]) and torch.equal(dests[i].v[keep], before[i][1][keep])

def test_fused_apply_layers_mixed_layouts_and_paged():
    """Layers laid out differently (one destination in another dtype; a strided content) and a
    paged cache with a shared slot mapping: the native backend agrees with the reference."""
    L, H, T, d = 3, 2, 21, 64
    rope, k, v, kf, vf, cos, sin = _layers_case(L, H, T, d)
    ref_dests = _dests(L, H, T, d, torch.bfloat16)
    dests = [ContiguousDest(dd.k.clone(), dd.v.clone(), dd.batch, dd.start) for dd in ref_dests]
    dests[2] = ContiguousDest(dests[2].k.float(), dests[2].v.float(), 1, 0)  # another dtype
    ref_dests[2] = ContiguousDest(ref_dests[2].k.float(), ref_dests[2].v.float(), 1, 0)
    ks = list(k)
    ks[1] = k[1].transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    fused_apply_layers(ks, v, rope, cos, sin, kf, vf, dests, backend="native")
    fused_apply_layers(k, v, rope, cos, sin, kf, vf, ref_dests, backend="reference")
    for i in range(L):
        _, _, sk, sv = oracle(k[i], v[i], rope, cos, sin, (kf[0][i], kf[1][i]), (vf[0][i], vf[1][i]))
        dt = dests[i].k.dtype
        assert_ulp_close(dests[i].k[1], ref_dests[i].k[1], sk, dt, 8, sides=2, what=f"layer {i} k")
        assert_ulp_close(dests[i].v[1], ref_dests[i].v[1], sv, dt, 8, sides=2, what=f"layer {i} v")
        assert torch.equal(dests[i].k[0], ref_dests[i].k[0])
    g = torch.Generator().manual_seed(22)
    slots = slot_mapping_from_block_table(torch.randperm(8, generator=g)[:6], 2, T, 4)
    caches = [[torch.randn(8, 4, H, d, generator=g).to(torch.bfloat16) for _ in range(2)] for _ in range(L)]
    ref = [[c.clone() for c in pair] for pair in caches]
    fused_apply_layers(k, v, rope, cos, sin, kf, vf, [PagedDest(a, b, slots) for a, b in caches], backend="native")
    fused_apply_layers(k, v, rope, cos, sin, kf, vf, [PagedDest(a, b, slots) for a, b in ref], backend="reference")
    for i in range(L):
        _, _, sk, sv = oracle(k[i], v[i], rope, cos, sin, (kf[0][i], kf[1][i]), (vf[0][i], vf[1][i]))
        blk, off = slots // 4, slots % 4
        assert_ulp_close(caches[i][0][blk, off], ref[i][0][blk, off], sk.transpose(0, 1), torch.bfloat16, 8, sides=2)
        assert_ulp_close(caches[i][1][blk, off], ref[i][1][blk, off], sv.transpose(0, 1), torch.bfloat16, 8, sides=2)
        keep = torch.ones(8, 4, dtype=torch.bool)
        keep[blk, off] = False
        assert torch.equal(caches[i][0][keep], ref[i][0][keep])

def test_fused_apply_layers_takes_one_native_call(monkeypatch):
    """Layers laid out alike go to the kernel in one call; unlike layers fall back to per-layer jobs."""
    if not native.available():
        pytest.fail(f"native kernel unavailable here: {native.unavailable_reason()}")
    calls = {"layers": 0, "jobs": 0}
    real_layers, real_jobs = native.run_layers, native.run_jobs

    def count(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(native, "run_layers", count("layers", real_layers))
    monkeypatch.setattr(native, "run_jobs", count("jobs", real_jobs))
    L, H, T, d = 3, 2, 9, 64
    rope, k, v, kf, vf, cos, sin = _layers_case(L, H, T, d)
    fused_apply_layers(k, v, rope, cos, sin, kf, vf, _dests(L, H, T, d, torch.bfloat16), backend="native")
    assert calls == {"layers": 1, "jobs": 0}
    dests = _dests(L, H, T, d, torch.bfloat16)
    dests[1] = ContiguousDest(dests[1].k, dests[1].v, 0, 0)  # another batch row: not alike
    fused_apply_layers(k, v, rope, cos, sin, kf, vf, dests, backend="native")
    assert calls == {"layers": 1, "jobs": 1}

def test_fused_apply_layers_counts():
    L, H, T, d = 3, 2, 5, 64
    rope, k, v, kf, vf, cos, sin = _layers_case(L, H, T, d)
    with pytest.raises(KernelArgumentError):
        fused_apply_layers(k, v[:2], rope, cos, sin)
    with pytest.raises(KernelArgumentError):
        fused_apply_layers(k, v, rope, cos, sin, (kf[0][:2], kf[1][:2]))
    with pytest.raises(KernelArgumentError):
        fused_apply_layers(k, v, rope, torch.stack([cos, cos]), torch.stack([sin, sin]))
    with pytest.raises(KernelArgumentError):
        fused_apply_layers(list(k), list(v), rope, cos, sin, dests=_dests(2, H, T, d, torch.bfloat16))
    with pytest.raises(KernelArgumentError):
        fused_apply_layers(k[:0], v[:0], rope, cos, sin)
    with pytest.raises(KernelArgumentError):
        fused_apply_layers(k[0], v[0], rope, cos, sin)  # one layer's [H, T, d] is not a stack
