"""Tests of contextdeque.kernels: every backend against an independent float64 oracle.

Tolerance ("within one ULP"), used everywhere below. For an output value ``a`` and the exact value
``e`` (the float64 oracle), with ``S`` the sum of the magnitudes of every term that makes up that
value (``|c| + sum_j |u_j w_j|``, then ``|x1||cos| + |x2||sin|`` after rotation):

    |a - e| <= ulp_dtype(max(|a|, |e|)) + n_sides * (m + 4) * 2**-24 * S

The first term is one unit in the last place of the *storage* dtype at the value's own magnitude:
the final rounding is worth half of it, the other half lets two fp32 values that straddle a
rounding boundary of the storage dtype land on neighbouring values. The second is the classical
forward-error bound of an fp32 sum of ``m + 4`` terms (Higham's gamma_n; m = patch rank): two
correct fp32 implementations that only sum in a different order can differ by that much. For
bf16/fp16 it is orders of magnitude below one ULP, so those comparisons are "within one ULP" with
no further slack; for fp32 storage it is the binding term. ``n_sides`` is 1 against the oracle and
2 between two fp32 implementations. ``test_tolerance_can_fail`` shows the check rejects a value
just past the tolerance (two ULPs off, in 16-bit storage), an off-by-one position, a reversed
rotation and a missing patch, and accepts a value at half the tolerance.

The Triton kernel runs on CPU under ``TRITON_INTERPRET=1`` in a child pytest process (the
interpreter is chosen when triton decorates the kernel, i.e. at import, so it cannot be switched on
inside a process that imported the kernel already); the parent checks the child ran every case.
"""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

IN_INTERP_CHILD = os.environ.get("CD_KERNELS_INTERP_CHILD") == "1"
if IN_INTERP_CHILD:  # must precede the first triton import in this process
    os.environ["TRITON_INTERPRET"] = "1"

from contextdeque.core.errors import EmptyChunkError, KernelArgumentError, PatchError, PositionError, StorageDtypeError  # noqa: E402
from contextdeque.kernels import (  # noqa: E402
    ContiguousDest,
    PagedDest,
    RopeSpec,
    fused_apply,
    fused_apply_layers,
    reference_apply,
    select_backend,
    slot_mapping_from_block_table,
)
from contextdeque.kernels import native  # noqa: E402
from contextdeque.kernels.spec import build_jobs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_MANT = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
_EMIN = {torch.float32: -126, torch.bfloat16: -126, torch.float16: -14}
CPU_BACKENDS = ["native", "torch", "reference"]


# ----------------------------------------------------------------------------- oracle & tolerance


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at magnitude ``|x|`` (float64 in, float64 out); subnormal spacing near 0."""
    x = x.abs().to(torch.float64)
    _, e = torch.frexp(x)  # |x| = f * 2**e, f in [0.5, 1)
    spacing = torch.ldexp(torch.ones_like(x), e - 1 - _MANT[dtype])
    tiny = 2.0 ** (_EMIN[dtype] - _MANT[dtype])
    return torch.where(x == 0, torch.full_like(x, tiny), spacing.clamp_min(tiny))


def assert_ulp_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    rank: int,
    sides: int = 1,
    what: str = "",
) -> None:
    """The module docstring's tolerance; raises AssertionError naming the worst offender."""
    a, e = actual.to(torch.float64), expected.to(torch.float64)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite output"
    tol = ulp(torch.maximum(a.abs(), e.abs()), dtype) + sides * (rank + 4) * 2.0**-24 * scale.to(torch.float64)
    err = (a - e).abs()
    bad = err > tol
    if bad.any():
        i = int(torch.argmax((err / tol).flatten()))
        idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), a.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} values beyond 1 ulp ({dtype}); worst at {idx}: "
            f"got {a[idx].item():.9g}, expected {e[idx].item():.9g}, |err| {err[idx].item():.3g} > tol {tol[idx].item():.3g}"
        )


def _pairs(start: int, dim: int, interleaved: bool) -> tuple[list[int], list[int]]:
    half = dim // 2
    if interleaved:
        return [start + 2 * p for p in range(half)], [start + 2 * p + 1 for p in range(half)]
    return [start + p for p in range(half)], [start + half + p for p in range(half)]


def oracle(k, v, rope, cos, sin, kf=None, vf=None):
    """float64 truth and magnitude scales: ``(k, v, k_scale, v_scale)``, each ``[H, T, d]``.

    Independent of the kernels: the rotation is a complex multiplication ``(x1 + i x2) e^{i theta}``
    with ``e^{i theta} = cos + i sin`` taken from the same fp32 tables."""

    def plus_delta(c, f):
        x, s = c.to(torch.float64), c.to(torch.float64).abs()
        if f is not None and f[0].shape[1] > 0:
            u, w = f[0].to(torch.float64), f[1].to(torch.float64)
            H, T, d = c.shape
            x = x + (u @ w).reshape(T, H, d).permute(1, 0, 2)
            s = s + (u.abs() @ w.abs()).reshape(T, H, d).permute(1, 0, 2)
        return x, s

    kx, ks = plus_delta(k, kf)
    vx, vs = plus_delta(v, vf)
    if rope is not None:
        x, s = (kx, ks) if rope.tensor == "k" else (vx, vs)
        i1, i2 = _pairs(rope.start, rope.dim, rope.interleaved)
        z = torch.complex(x[..., i1], x[..., i2]) * torch.complex(cos.to(torch.float64), sin.to(torch.float64))
        s1, s2 = s[..., i1], s[..., i2]
        c_abs, s_abs = cos.to(torch.float64).abs(), sin.to(torch.float64).abs()
        x[..., i1], x[..., i2] = z.real, z.imag
        s[..., i1], s[..., i2] = s1 * c_abs + s2 * s_abs, s2 * c_abs + s1 * s_abs
    return kx, vx, ks, vs


def rope_tables(positions: torch.Tensor, dim: int, base: float = 10000.0):
    """fp32 cos/sin ``[T, dim/2]`` the way the model builds them: angle = fp32(pos) * fp32(inv_freq)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    ang = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cos(ang), torch.sin(ang)


def make_inputs(H, T, d, rank, dtype, rope, seed=0, v_shape=None, v_rank=None, start_pos=None):
    """Random content/factors in ``dtype`` and fp32 tables for positions start_pos + arange(T)."""
    g = torch.Generator().manual_seed(seed)
    Hv, dv = v_shape if v_shape is not None else (H, d)
    k = torch.randn(H, T, d, generator=g).to(dtype)
    v = torch.randn(Hv, T, dv, generator=g).to(dtype)

    def factors(m, width):
        if m is None or m == 0:
            return None
        return (torch.randn(T, m, generator=g).to(dtype), (0.3 * torch.randn(m, width, generator=g)).to(dtype))

    kf = factors(rank, H * d)
    vf = factors(rank if v_rank is None else v_rank, Hv * dv)
    if rope is None:
        return k, v, kf, vf, None, None
    p0 = int(torch.randint(0, 50_000, (1,), generator=g)) if start_pos is None else start_pos
    cos, sin = rope_tables(p0 + torch.arange(T), rope.dim)
    return k, v, kf, vf, cos, sin


def _rank(f) -> int:
    return 0 if f is None else int(f[0].shape[1])


def check_against_oracle(out_k, out_v, k, v, rope, cos, sin, kf, vf, what=""):
    ek, ev, sk, sv = oracle(k, v, rope, cos, sin, kf, vf)
    assert_ulp_close(out_k, ek, sk, out_k.dtype, _rank(kf), what=f"{what} k")
    assert_ulp_close(out_v, ev, sv, out_v.dtype, _rank(vf), what=f"{what} v")


# ----------------------------------------------------------------------------- the cases

# (name, H, T, d, RopeSpec or None, v_shape or None); used by the CPU backends and the interpreter
HEAD_DIMS = [64, 128, 192, 256]
RANKS = [0, 1, 16, 64]
VARIANTS = {
    "partial_rotary_low": (2, 13, 128, RopeSpec("k", 0, 64), None),
    "partial_rotary_high": (2, 13, 128, RopeSpec("k", 64, 64), None),  # rope on the upper channels
    "partial_rotary_mid": (1, 11, 80, RopeSpec("k", 16, 32), None),
    "interleaved_64": (2, 13, 64, RopeSpec("k", 0, 64, True), None),
    "interleaved_partial": (2, 9, 128, RopeSpec("k", 0, 64, True), None),
    "mla_half": (1, 13, 512, RopeSpec("v", 0, 64), (1, 64)),  # k = latent (no rope), v = k_pe
    "mla_interleaved": (1, 13, 512, RopeSpec("v", 0, 64, True), (1, 64)),
    "no_rope": (2, 7, 64, None, None),
    "multi_block": (2, 37, 64, RopeSpec("k", 0, 64), None),  # > one token block of every backend
}


def stacked_layers_case(L, H, T, d, m, dtype, seed=100):
    """A chunk of L layers as the operator passes it: stacked contents ``[L, H, T, d]``, stacked
    factors and per-layer tables ``[L, T, d/2]``; with the per-layer inputs for the oracle."""
    rope = RopeSpec("k", 0, d)
    layers = [make_inputs(H, T, d, m, dtype, rope, seed=seed + i) for i in range(L)]
    stack = lambda j: torch.stack([x[j] for x in layers])  # noqa: E731
    kf = (torch.stack([x[2][0] for x in layers]), torch.stack([x[2][1] for x in layers]))
    vf = (torch.stack([x[3][0] for x in layers]), torch.stack([x[3][1] for x in layers]))
    return rope, stack(0), stack(1), kf, vf, stack(4), stack(5), layers


def check_layers_against_oracle(out, rope, layers, m, what=""):
    for i, (k, v, kf, vf, cos, sin) in enumerate(layers):
        ek, ev, sk, sv = oracle(k, v, rope, cos, sin, kf, vf)
        assert_ulp_close(out[i][0].cpu(), ek, sk, k.dtype, m, what=f"{what} layer {i} k")
        assert_ulp_close(out[i][1].cpu(), ev, sv, v.dtype, m, what=f"{what} layer {i} v")


def run_backend(backend, k, v, rope, cos, sin, kf, vf, out_dtype=None):
    return fused_apply(k, v, rope, cos, sin, kf, vf, out_dtype=out_dtype, backend=backend)


# ----------------------------------------------------------------------------- CPU backends (parent)

if not IN_INTERP_CHILD:

    def test_tolerance_can_fail():
        """The comparison rejects 2-ulp errors, off-by-one positions, reversed rotation, a lost patch."""
        H, T, d = 2, 9, 64
        rope = RopeSpec("k", 0, 64)
        for dtype in DTYPES:
            k, v, kf, vf, cos, sin = make_inputs(H, T, d, 16, dtype, rope, seed=1, start_pos=100)
            ok_k, _ = reference_apply(k, v, rope, cos, sin, kf, vf)
            ek, _, sk, _ = oracle(k, v, rope, cos, sin, kf, vf)
            assert_ulp_close(ok_k, ek, sk, dtype, 16, what="sanity")

            # one value moved just past the tolerance fails; half of it passes
            x, e = ok_k[1, 4, 7].to(torch.float64), ek[1, 4, 7]
            tol = ulp(torch.maximum(x.abs(), e.abs()), dtype) + (16 + 4) * 2.0**-24 * sk[1, 4, 7]
            for step, fails in ((tol * 1.01, True), (tol * 0.5, False)):
                bumped = ok_k.to(torch.float64)
                bumped[1, 4, 7] = e + step
                if fails:
                    with pytest.raises(AssertionError):
                        assert_ulp_close(bumped, ek, sk, dtype, 16, what="bumped")
                else:
                    assert_ulp_close(bumped, ek, sk, dtype, 16, what="half bump")
            if dtype != torch.float32:  # 16-bit storage: two ulps off is already too far
                bumped = ok_k.clone()
                bumped[1, 4, 7] = (x + 2 * ulp(x, dtype)).to(dtype)
                with pytest.raises(AssertionError):
                    assert_ulp_close(bumped, ek, sk, dtype, 16, what="two ulps")

            c1, s1 = rope_tables(101 + torch.arange(T), 64)  # placed one position later
            off_k, _ = reference_apply(k, v, rope, c1, s1, kf, vf)
            with pytest.raises(AssertionError):
                assert_ulp_close(off_k, ek, sk, dtype, 16, what="off by one")

            rev_k, _ = reference_apply(k, v, rope, cos, -sin, kf, vf)  # rotated the wrong way
            with pytest.raises(AssertionError):
                assert_ulp_close(rev_k, ek, sk, dtype, 16, what="reversed")

            bare_k, _ = reference_apply(k, v, rope, cos, sin, None, vf)  # patch dropped
            with pytest.raises(AssertionError):
                assert_ulp_close(bare_k, ek, sk, dtype, 16, what="no patch")

    def test_ulp_helper():
        assert ulp(torch.tensor([1.0]), torch.float32).item() == 2.0**-23
        assert ulp(torch.tensor([1.0]), torch.bfloat16).item() == 2.0**-7
        assert ulp(torch.tensor([1.5]), torch.float16).item() == 2.0**-10
        assert ulp(torch.tensor([0.0]), torch.float32).item() == 2.0**-149
        assert ulp(torch.tensor([1e-40]), torch.float32).item() == 2.0**-149  # subnormal spacing
        one_up = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
        assert (one_up - 1.0).item() == ulp(torch.tensor([1.0]), torch.float32).item()

    # -- reference math vs the independent oracle

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("name", sorted(VARIANTS))
    def test_reference_matches_oracle(name, dtype):
        H, T, d, rope, v_shape = VARIANTS[name]
        k, v, kf, vf, cos, sin = make_inputs(H, T, d, 16, dtype, rope, seed=2, v_shape=v_shape)
        ok, ov = reference_apply(k, v, rope, cos, sin, kf, vf)
        check_against_oracle(ok, ov, k, v, rope, cos, sin, kf, vf, what=f"reference {name}")

    def test_rotation_is_explicit_2x2_rotation():
        """Reference rotation == explicit 2x2 matrices [[c, -s], [s, c]] per pair, in float64."""
        H, T, d = 1, 5, 8
        rope = RopeSpec("k", 0, 8)
        k, v, _, _, cos, sin = make_inputs(H, T, d, 0, torch.float32, rope, seed=3)
        ok, _ = reference_apply(k, v, rope, cos, sin)
        for t in range(T):
            for p in range(4):
                c, s = float(cos[t, p]), float(sin[t, p])
                x1, x2 = float(k[0, t, p]), float(k[0, t, p + 4])
                want = (c * x1 - s * x2, s * x1 + c * x2)
                got = (float(ok[0, t, p]), float(ok[0, t, p + 4]))
                scale = abs(c * x1) + abs(s * x2) + abs(s * x1) + abs(c * x2)
                for g_, w_ in zip(got, want):
                    assert abs(g_ - w_) <= 2**-23 * max(abs(w_), 1e-30) + 4 * 2**-24 * scale

    def test_identity_rotation_and_rank0_is_exact_copy():
        """cos = 1, sin = 0 and no patch: every backend returns the content bit for bit."""
        H, T, d = 2, 50, 64
        rope = RopeSpec("k", 0, 64)
        for dtype in DTYPES:
            k, v, _, _, _, _ = make_inputs(H, T, d, 0, dtype, rope, seed=4)
            ones, zeros = torch.ones(T, 32), torch.zeros(T, 32)
            for backend in CPU_BACKENDS:
                ok, ov = run_backend(backend, k, v, rope, ones, zeros, None, None)
                assert torch.equal(ok, k) and torch.equal(ov, v), (backend, dtype)

    def test_relocation_composes_like_positions():
        """Placing at p then un-rotating by p returns the content (R(-p)R(p) = I up to rounding)."""
        H, T, d = 2, 10, 64
        rope = RopeSpec("k", 0, 64)
        k, v, _, _, cos, sin = make_inputs(H, T, d, 0, torch.float32, rope, seed=5, start_pos=12345)
        ok, _ = reference_apply(k, v, rope, cos, sin)
        back, _ = reference_apply(ok, v, rope, cos, -sin)
        assert torch.allclose(back, k, atol=4e-6, rtol=0)

    # -- fast CPU paths vs the oracle

    @pytest.mark.parametrize("backend", ["native", "torch"])
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("d", HEAD_DIMS)
    @pytest.mark.parametrize("rank", RANKS)
    def test_cpu_backends_head_dims_and_ranks(backend, dtype, d, rank):
        H, T = 3, 61  # several native token tiles, odd length
        rope = RopeSpec("k", 0, d)
        k, v, kf, vf, cos, sin = make_inputs(H, T, d, rank, dtype, rope, seed=d + rank)
        ok, ov = run_backend(backend, k, v, rope, cos, sin, kf, vf)
        check_against_oracle(ok, ov, k, v, rope, cos, sin, kf, vf, what=f"{backend} d={d} m={rank}")

    @pytest.mark.parametrize("backend", ["native", "torch"])
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("name", sorted(VARIANTS))
    def test_cpu_backends_variants(backend, dtype, name):
        H, T, d, rope, v_shape = VARIANTS[name]
        k, v, kf, vf, cos, sin = make_inputs(H, T, d, 16, dtype, rope, seed=7, v_shape=v_shape, v_rank=5)
        ok, ov = run_backend(backend, k, v, rope, cos, sin, kf, vf)
        check_against_oracle(ok, ov, k, v, rope, cos, sin, kf, vf, what=f"{backend} {name}")

    @pytest.mark.parametrize("d,rope", [(72, RopeSpec("k", 0, 72)), (64, RopeSpec("k", 8, 24)), (40, RopeSpec("k", 4, 20, True))])
    def test_native_generic_row_path(d, rope):
        """Head dims / rotary slices that are not multiples of the SIMD width take the scalar row path."""
        for dtype in DTYPES:
            k, v, kf, vf, cos, sin = make_inputs(2, 53, d, 7, dtype, rope, seed=d)
            ok, ov = run_backend("native", k, v, rope, cos, sin, kf, vf)
            check_against_oracle(ok, ov, k, v, rope, cos, sin, kf, vf, what=f"native generic d={d}")

    def test_cpu_backends_large_rank_and_mixed_dtypes():
        """Rank 128 (the maximum); fp32 factors on bf16 content; bf16 content into an fp32 destination."""
        rope = RopeSpec("k", 0, 128)
        k, v, kf, vf, cos, sin = make_inputs(2, 30, 128, 128, torch.bfloat16, rope, seed=8)
        for backend in ["native", "torch"]:
            ok, ov = run_backend(backend, k, v, rope, cos, sin, kf, vf)
            check_against_oracle(ok, ov, k, v, rope, cos, sin, kf, vf, what=f"{backend} rank 128")
            kf32 = (kf[0].float(), kf[1].float())
            ok, ov = run_backend(backend, k, v, rope, cos, sin, kf32, vf)
            check_against_oracle(ok, ov, k, v, rope, cos, sin, kf32, vf, what=f"{backend} fp32 factors")
            ok, ov = run_backend(backend, k, v, rope, cos, sin, kf, vf, out_dtype=torch.float32)
            assert ok.dtype == torch.float32
            check_against_oracle(ok, ov, k, v, rope, cos, sin, kf, vf, what=f"{backend} fp32 out")

    def test_native_matches_reference_within_ulp_and_thread_count_invariant():
        rope = RopeSpec("k", 0, 64)
        k, v, kf, vf, cos, sin = make_inputs(3, 200, 64, 32, torch.bfloat16, rope, seed=9)
        ek, ev, sk, sv = oracle(k, v, rope, cos, sin, kf, vf)
        rk, rv = run_backend("reference", k, v, rope, cos, sin, kf, vf)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = run_backend("native", k, v, rope, cos, sin, kf, vf)
            torch.set_num_threads(2)
            two = run_backend("native", k, v, rope, cos, sin, kf, vf)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
        assert_ulp_close(one[0], rk, sk, torch.bfloat16, 32, sides=2, what="native vs reference k")
        assert_ulp_close(one[1], rv, sv, torch.bfloat16, 32, sides=2, what="native vs reference v")

    @pytest.mark.parametrize("backend", ["native", "torch"])
    def test_subnormal_results_are_not_flushed(backend):
        """Values near 1e-39 (subnormal in fp32 and bf16) survive rotation and rounding: the
        native bf16 store uses a rounding instruction that flushes subnormals only when none is
        present, and falls back to exact rounding otherwise."""
        rope = RopeSpec("k", 0, 64)
        for dtype in (torch.float32, torch.bfloat16):
            k, v, _, _, cos, sin = make_inputs(2, 20, 64, 0, torch.float32, rope, seed=50)
            k, v = (k * 1e-39).to(dtype), (v * 1e-39).to(dtype)
            assert (k != 0).float().mean() > 0.9  # really subnormal, not zero
            ok, ov = run_backend(backend, k, v, rope, cos, sin, None, None)
            assert (ok != 0).float().mean() > 0.9
            check_against_oracle(ok, ov, k, v, rope, cos, sin, None, None, what=f"{backend} subnormal {dtype}")

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_native_streaming_stores(dtype, monkeypatch):
        """Calls larger than the last-level cache write with non-temporal stores; force that path
        on small inputs (aligned and unaligned destination rows, copies, rotations, patches)."""
        if not native.available():
            pytest.fail(f"native kernel unavailable here: {native.unavailable_reason()}")
        monkeypatch.setattr(native, "STREAM_MIN_BYTES", 0)
        for d, rope, rank, start in ((64, RopeSpec("k", 0, 64), 0, 3), (128, RopeSpec("k", 0, 128), 16, 0), (64, RopeSpec("k", 0, 64, True), 4, 1)):
            k, v, kf, vf, cos, sin = make_inputs(3, 100, d, rank, dtype, rope, seed=d + rank)
            dk = torch.zeros(1, 3, 110, d, dtype=dtype)
            dv = torch.zeros(1, 3, 110, d, dtype=dtype)
            fused_apply(k, v, rope, cos, sin, kf, vf, ContiguousDest(dk, dv, 0, start), backend="native")
            check_against_oracle(dk[0, :, start : start + 100], dv[0, :, start : start + 100], k, v, rope, cos, sin, kf, vf, what="streamed")
            assert dk[0, :, :start].abs().sum() == 0 and dk[0, :, start + 100 :].abs().sum() == 0

    @pytest.mark.parametrize("backend", ["native", "torch"])
    def test_strided_inputs(backend):
        """Content as a transposed view of a [T, H, d] buffer, factors with padded rows, and a content
        with non-unit channel stride (the native backend hands that one to torch)."""
        H, T, d = 3, 40, 64
        rope = RopeSpec("k", 0, 64)
        g = torch.Generator().manual_seed(10)
        k = torch.randn(T, H, d, generator=g).to(torch.bfloat16).transpose(0, 1)  # [H, T, d], strided
        v = torch.randn(H, T, 2 * d, generator=g)[..., ::2]  # channel stride 2
        u = torch.randn(T, 24, generator=g)[:, :16]
        w = (0.3 * torch.randn(16, H * d + 8, generator=g))[:, : H * d]
        cos, sin = rope_tables(torch.arange(T) + 7, 64)
        ok, ov = run_backend(backend, k, v, rope, cos, sin, (u, w), (u, w))
        check_against_oracle(ok, ov, k, v, rope, cos, sin, (u, w), (u, w), what=f"{backend} strided")

    # -- destinations

    @pytest.mark.parametrize("backend", CPU_BACKENDS)
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_contiguous_dest_touches_only_the_chunk(backend, dtype):
        H, T, d, B, T_total, b, s = 2, 11, 64, 3, 40, 1, 7
        rope = RopeSpec("k", 0, 64)
        k, v, kf, vf, cos, sin = make_inputs(H, T, d, 8, dtype, rope, seed=11)
        g = torch.Generator().manual_seed(12)
        dk = torch.randn(B, H, T_total, d, generator=g).to(dtype)  # stale data everywhere
        dv = torch.randn(B, H, T_total, d, generator=g).to(dtype)
        before_k, before_v = dk.clone(), dv.clone()
        assert fused_apply(k, v, rope, cos, sin, kf, vf, ContiguousDest(dk, dv, b, s), backend=backend) is None
        check_against_oracle(dk[b, :, s : s + T], dv[b, :, s : s + T], k, v, rope, cos, sin, kf, vf, what=backend)
        keep = torch.ones(B, H, T_total, d, dtype=torch.bool)
        keep[b, :, s : s + T] = False
        assert torch.equal(dk[keep], before_k[keep]) and torch.equal(dv[keep], before_v[keep])

    @pytest.mark.parametrize("backend", CPU_BACKENDS)
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("block_size,start", [(4, 5), (16, 0), (16, 13)])
    def test_paged_dest_random_block_table(backend, dtype, block_size, start):
        """Random block table, chunk starting mid-block, partially filled last block, one padding slot."""
        H, T, d, num_blocks = 2, 23, 64, 12
        rope = RopeSpec("k", 0, 64, interleaved=block_size == 4)
        k, v, kf, vf, cos, sin = make_inputs(H, T, d, 8, dtype, rope, seed=block_size + start)
        g = torch.Generator().manual_seed(13)
        n_needed = (start + T + block_size - 1) // block_size
        table = torch.randperm(num_blocks, generator=g)[:n_needed]
        slots = slot_mapping_from_block_table(table, start, T, block_size)
        slots[5] = -1  # a padding token: never written
        kc = torch.randn(num_blocks, block_size, H, d, generator=g).to(dtype)
        vc = torch.randn(num_blocks, block_size, H, d, generator=g).to(dtype)
        before_k, before_v = kc.clone(), vc.clone()
        fused_apply(k, v, rope, cos, sin, kf, vf, PagedDest(kc, vc, slots), backend=backend)
        ek, ev, sk, sv = oracle(k, v, rope, cos, sin, kf, vf)
        live = slots >= 0
        blk, off = slots[live] // block_size, slots[live] % block_size
        assert_ulp_close(kc[blk, off].transpose(0, 1), ek[:, live], sk[:, live], dtype, 8, what=f"{backend} paged k")
        assert_ulp_close(vc[blk, off].transpose(0, 1), ev[:, live], sv[:, live], dtype, 8, what=f"{backend} paged v")
        keep = torch.ones(num_blocks, block_size, dtype=torch.bool)
        keep[blk, off] = False
        assert torch.equal(kc[keep], before_k[keep]) and torch.equal(vc[keep], before_v[keep])

    def test_slot_mapping_from_block_table():
        table = torch.tensor([7, 2, 5])
        slots = slot_mapping_from_block_table(table, 3, 6, 4)
        # positions 3..8 -> logical blocks 0,1,1,1,1,2 -> physical 7,2,2,2,2,5
        assert slots.tolist() == [7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 5 * 4 + 0]
        with pytest.raises(PositionError):
            slot_mapping_from_block_table(table, 10, 3, 4)  # needs a 4th block

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

    # -- argument checking

    def test_argument_errors():
        rope = RopeSpec("k", 0, 64)
        k, v, kf, vf, cos, sin = make_inputs(2, 8, 64, 4, torch.float32, rope, seed=30)
        with pytest.raises(KernelArgumentError):
            fused_apply(k[0], v, rope, cos, sin)  # not [H, T, d]
        with pytest.raises(KernelArgumentError):
            fused_apply(k, v[:, :5], rope, cos, sin)  # token counts differ
        with pytest.raises(KernelArgumentError):
            fused_apply(k, v, rope, cos[:, :16], sin)  # wrong table width
        with pytest.raises(KernelArgumentError):
            fused_apply(k, v, rope, cos.double(), sin)  # tables must be fp32
        with pytest.raises(KernelArgumentError):
            fused_apply(k, v, RopeSpec("k", 32, 64), cos, sin)  # slice past the head dim
        with pytest.raises(KernelArgumentError):
            RopeSpec("k", 0, 63)
        with pytest.raises(KernelArgumentError):
            RopeSpec("q", 0, 64)  # type: ignore[arg-type]
        with pytest.raises(StorageDtypeError):
            fused_apply(k.double(), v, rope, cos, sin)
        with pytest.raises(EmptyChunkError):
            fused_apply(k[:, :0], v[:, :0], rope, cos[:0], sin[:0])
        with pytest.raises(PatchError):
            fused_apply(k, v, rope, cos, sin, (kf[0][:5], kf[1]))
        with pytest.raises(PatchError):
            fused_apply(k, v, rope, cos, sin, kf[0])  # not a pair
        big = (torch.zeros(8, 129), torch.zeros(129, 128))
        with pytest.raises(PatchError):
            fused_apply(k, v, rope, cos, sin, big)
        dest = ContiguousDest(torch.zeros(1, 2, 10, 64), torch.zeros(1, 2, 10, 64), batch=0, start=5)
        with pytest.raises(PositionError):
            fused_apply(k, v, rope, cos, sin, dest=dest)  # 5 + 8 > 10
        with pytest.raises(PositionError):
            fused_apply(k, v, rope, cos, sin, dest=ContiguousDest(dest.k, dest.v, batch=1))
        with pytest.raises(KernelArgumentError):
            fused_apply(k, v, rope, cos, sin, dest=ContiguousDest(torch.zeros(1, 3, 10, 64), dest.v))
        cache = torch.zeros(2, 4, 2, 64)
        with pytest.raises(PositionError):
            fused_apply(k, v, rope, cos, sin, dest=PagedDest(cache, cache.clone(), torch.arange(8) + 1))  # slot 8 > 7
        with pytest.raises(KernelArgumentError):
            fused_apply(k, v, rope, cos, sin, dest=PagedDest(cache, cache.clone(), torch.arange(8, dtype=torch.int32)))
        with pytest.raises(KernelArgumentError):
            fused_apply(k, v, rope, cos, sin, backend="cuda-magic")  # type: ignore[arg-type]

    # -- dispatch

    def test_dispatch_selects_a_cpu_path_without_cuda():
        """CPU tensors never go to Triton under "auto" (TRITON_INTERPRET or not); CUDA ones do."""
        assert select_backend("cpu") == ("native" if native.available() else "torch")
        if torch.cuda.is_available():
            from contextdeque.kernels import triton_fused

            assert select_backend("cuda") == ("triton" if triton_fused.HAVE_TRITON else "torch")
        with pytest.raises(KernelArgumentError):  # Triton on CPU only under the interpreter
            rope = RopeSpec("k", 0, 64)
            k, v, _, _, cos, sin = make_inputs(1, 4, 64, 0, torch.float32, rope)
            fused_apply(k, v, rope, cos, sin, backend="triton")

    def _run_py(code: str, **env_over: str) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
        env.update(env_over)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.strip()

    def test_dispatch_selects_torch_without_native_or_cuda(tmp_path):
        """No TRITON_INTERPRET, no CUDA, native kernel disabled or uncompilable: the torch path, and it works."""
        code = (
            "import torch, contextdeque.kernels as K\n"
            "from contextdeque.kernels import native\n"
            "k = torch.randn(2, 5, 64); c = torch.ones(5, 32); s = torch.zeros(5, 32)\n"
            "out = K.fused_apply(k, k, K.RopeSpec('k', 0, 64), c, s)\n"
            "assert torch.equal(out[0], k)\n"
            "print(K.select_backend('cpu'), native.available(), native.unavailable_reason())\n"
        )
        out = _run_py(code, CONTEXTDEQUE_NATIVE="0", CUDA_VISIBLE_DEVICES="")
        assert out.startswith("torch False disabled"), out
        out = _run_py(
            code, CC=str(tmp_path / "no-such-cc"), PATH="/nonexistent", CONTEXTDEQUE_KERNEL_CACHE=str(tmp_path / "c"),
            CUDA_VISIBLE_DEVICES="",
        )
        assert out.startswith("torch False RuntimeError: no C compiler"), out

    def test_kernels_import_without_triton():
        code = (
            "import sys; sys.modules['triton'] = None\n"  # makes `import triton` fail
            "import torch, contextdeque.kernels as K\n"
            "from contextdeque.kernels import triton_fused\n"
            "assert not triton_fused.HAVE_TRITON\n"
            "k = torch.randn(1, 3, 64)\n"
            "K.fused_apply(k, k, K.RopeSpec('k', 0, 64), torch.ones(3, 32), torch.zeros(3, 32))\n"
            "from contextdeque.core.errors import KernelArgumentError\n"
            "try:\n"
            "    K.fused_apply(k, k, None, None, None, backend='triton')\n"
            "except KernelArgumentError:\n"
            "    print('refused')\n"
        )
        assert _run_py(code) == "refused"

    def test_native_portable_code_paths(tmp_path):
        """The AVX2+F16C and plain-C builds of the kernel (an AVX-512 machine runs the AVX-512 one)
        agree with the oracle too (built for another -march in a child process), and a build is
        cached and reused."""
        import platform

        marches = ["haswell", "x86-64"] if platform.machine() in ("x86_64", "AMD64") else ["native"]
        code = (
            "import sys, torch\n"
            "sys.path.insert(0, 'tests')\n"
            "import test_kernels as t\n"
            "from contextdeque.kernels import native, RopeSpec\n"
            "assert native.available(), native.unavailable_reason()\n"
            "cases = [(64, RopeSpec('k', 0, 64), 16), (128, RopeSpec('k', 0, 64, True), 5), (72, RopeSpec('k', 8, 24), 3)]\n"
            "for dtype in t.DTYPES:\n"
            "    for d, rope, m in cases:\n"
            "        k, v, kf, vf, cos, sin = t.make_inputs(2, 53, d, m, dtype, rope, seed=d)\n"
            "        ok, ov = t.run_backend('native', k, v, rope, cos, sin, kf, vf)\n"
            "        t.check_against_oracle(ok, ov, k, v, rope, cos, sin, kf, vf, what=f'{d} {dtype}')\n"
            "print('ok', native.vector_width())\n"
        )
        for march in marches:
            cache = tmp_path / march
            want = "ok 8" if march != "native" else f"ok {native.vector_width()}"
            assert _run_py(code, CONTEXTDEQUE_NATIVE_MARCH=march, CONTEXTDEQUE_KERNEL_CACHE=str(cache)) == want
            built = sorted(p.name for p in cache.iterdir())
            assert len(built) == 1 and built[0].endswith(".so"), built
        # a second process loads the cached build, even without any compiler on PATH
        out = _run_py(code, CONTEXTDEQUE_NATIVE_MARCH=march, CONTEXTDEQUE_KERNEL_CACHE=str(cache), CC="/nonexistent-cc", PATH="/nonexistent")
        assert out == want

    def test_kernels_import_only_errors_from_contextdeque():
        """Layering: kernels/ imports nothing from contextdeque except contextdeque.core.errors, relatively."""
        for path in sorted((REPO / "kernels").glob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    if node.level == 0:
                        assert not (node.module or "").startswith(("contextdeque", "kernels")), (path.name, node.module)
                    elif node.level >= 2:
                        assert node.level == 2 and node.module == "core.errors", (path.name, node.module)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        assert not alias.name.startswith(("contextdeque", "kernels")), (path.name, alias.name)

    @pytest.mark.parametrize(
        "dtype,rank,mixed,expected",
        [
            (torch.float32, 16, False, ("tf32x3", True)),
            (torch.float32, 64, False, ("tf32x3", True)),
            (torch.float32, 1, False, ("ieee", False)),  # measured past the tolerance with tf32x3
            (torch.float32, 32, True, ("ieee", False)),  # widened mixed factors: untested with tf32x3
            (torch.bfloat16, 32, False, ("ieee", False)),  # 16-bit operands: exact products, no fp32 dot
        ],
    )
    def test_triton_fp32_dot_precision_choice(dtype, rank, mixed, expected, monkeypatch):
        """Which precision the Triton launch gives ``tl.dot`` (no kernel runs: the launch is recorded)."""
        from contextdeque.kernels import triton_fused

        seen = {}

        class Recorder:
            def __getitem__(self, grid):
                return lambda *args, **kw: seen.update(kw)

        monkeypatch.setattr(triton_fused, "_fused_kernel", Recorder())
        monkeypatch.setattr(triton_fused, "interpreting", lambda: False)
        rope = RopeSpec("k", 0, 64)
        k, v, kf, vf, cos, sin = make_inputs(2, 9, 64, rank, dtype, rope, seed=3)
        if mixed:
            kf = (kf[0], kf[1].to(torch.bfloat16))
        job = build_jobs(k, v, rope, cos, sin, kf, vf, ContiguousDest(torch.empty(1, 2, 9, 64, dtype=dtype), torch.empty(1, 2, 9, 64, dtype=dtype)))[0]
        triton_fused._launch(job)
        assert (seen["FP32_PRECISION"], seen["DOT_THEN_ADD"]) == expected
        if dtype == torch.bfloat16:
            assert not seen["FP32_DOT"]

    def test_bench_helpers_smoke():
        from contextdeque.kernels.bench_util import bench_apply

        r = bench_apply(8, rank=4, layers=2, heads=1, head_dim=64, rounds=2)
        assert r.gemm_s is not None and r.memcpy_s > 0 and r.apply_s > 0
        assert r.floor_s == max(r.memcpy_s, r.gemm_s) and math.isclose(r.ratio, r.apply_s / r.floor_s)
        r0 = bench_apply(8, rank=0, layers=2, heads=1, head_dim=64, rounds=2, dtype=torch.bfloat16, per_layer=True)
        assert r0.gemm_s is None and r0.floor_s == r0.memcpy_s


# ----------------------------------------------------------------------------- Triton (interpreter)

INTERP_DTYPES = DTYPES
INTERP_MAIN = [(d, r) for d in HEAD_DIMS for r in RANKS]
INTERP_VARIANTS = sorted(VARIANTS)
INTERP_PAGED = [(4, 5), (16, 13)]
N_INTERP_CASES = len(INTERP_DTYPES) * (len(INTERP_MAIN) + len(INTERP_VARIANTS) + len(INTERP_PAGED) + 1 + 4) + 4

if IN_INTERP_CHILD:

    def _triton_vs_reference(k, v, rope, cos, sin, kf, vf, what):
        tk, tv = run_backend("triton", k, v, rope, cos, sin, kf, vf)
        rk, rv = run_backend("reference", k, v, rope, cos, sin, kf, vf)
        _, _, sk, sv = oracle(k, v, rope, cos, sin, kf, vf)
        assert_ulp_close(tk, rk, sk, k.dtype, _rank(kf), sides=2, what=f"{what} k vs reference")
        assert_ulp_close(tv, rv, sv, v.dtype, _rank(vf), sides=2, what=f"{what} v vs reference")
        check_against_oracle(tk, tv, k, v, rope, cos, sin, kf, vf, what=f"{what} vs oracle")

    @pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
    @pytest.mark.parametrize("d,rank", INTERP_MAIN)
    def test_interp_head_dims_and_ranks(dtype, d, rank):
        rope = RopeSpec("k", 0, d)
        k, v, kf, vf, cos, sin = make_inputs(2, 13, d, rank, dtype, rope, seed=d * 7 + rank)
        _triton_vs_reference(k, v, rope, cos, sin, kf, vf, f"triton d={d} m={rank}")

    @pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
    @pytest.mark.parametrize("name", INTERP_VARIANTS)
    def test_interp_variants(dtype, name):
        H, T, d, rope, v_shape = VARIANTS[name]
        k, v, kf, vf, cos, sin = make_inputs(H, T, d, 16, dtype, rope, seed=41, v_shape=v_shape, v_rank=5)
        _triton_vs_reference(k, v, rope, cos, sin, kf, vf, f"triton {name}")

    @pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
    @pytest.mark.parametrize("block_size,start", INTERP_PAGED)
    def test_interp_paged(dtype, block_size, start):
        H, T, d, num_blocks = 2, 19, 64, 10
        rope = RopeSpec("k", 0, 64)
        k, v, kf, vf, cos, sin = make_inputs(H, T, d, 16, dtype, rope, seed=block_size)
        g = torch.Generator().manual_seed(43)
        table = torch.randperm(num_blocks, generator=g)[: (start + T + block_size - 1) // block_size]
        slots = slot_mapping_from_block_table(table, start, T, block_size)
        slots[3] = -1
        caches = [torch.randn(num_blocks, block_size, H, d, generator=g).to(dtype) for _ in range(2)]
        ref = [c.clone() for c in caches]
        fused_apply(k, v, rope, cos, sin, kf, vf, PagedDest(caches[0], caches[1], slots), backend="triton")
        fused_apply(k, v, rope, cos, sin, kf, vf, PagedDest(ref[0], ref[1], slots), backend="reference")
        _, _, sk, sv = oracle(k, v, rope, cos, sin, kf, vf)
        live = slots >= 0
        blk, off = slots[live] // block_size, slots[live] % block_size
        for got, want, scale in ((caches[0], ref[0], sk), (caches[1], ref[1], sv)):
            assert_ulp_close(got[blk, off], want[blk, off], scale[:, live].transpose(0, 1), dtype, 16, sides=2, what="paged")
            keep = torch.ones(num_blocks, block_size, dtype=torch.bool)
            keep[blk, off] = False
            assert torch.equal(got[keep], want[keep])  # untouched slots keep their stale data

    def test_interp_contiguous_dest_offset():
        H, T, d = 2, 9, 128
        rope = RopeSpec("k", 0, 64, interleaved=True)
        k, v, kf, vf, cos, sin = make_inputs(H, T, d, 16, torch.bfloat16, rope, seed=44)
        dk = torch.randn(2, H, 30, d).to(torch.bfloat16)
        dv = torch.randn(2, H, 30, d).to(torch.bfloat16)
        rk, rv = dk.clone(), dv.clone()
        fused_apply(k, v, rope, cos, sin, kf, vf, ContiguousDest(dk, dv, 1, 17), backend="triton")
        fused_apply(k, v, rope, cos, sin, kf, vf, ContiguousDest(rk, rv, 1, 17), backend="reference")
        _, _, sk, sv = oracle(k, v, rope, cos, sin, kf, vf)
        assert_ulp_close(dk[1, :, 17:26], rk[1, :, 17:26], sk, torch.bfloat16, 16, sides=2)
        assert_ulp_close(dv[1, :, 17:26], rv[1, :, 17:26], sv, torch.bfloat16, 16, sides=2)
        keep = torch.ones_like(dk, dtype=torch.bool)
        keep[1, :, 17:26] = False
        assert torch.equal(dk[keep], rk[keep]) and torch.equal(dv[keep], rv[keep])

    def test_interp_auto_never_picks_the_interpreter():
        assert os.environ["TRITON_INTERPRET"] == "1"
        assert select_backend("cpu") in ("native", "torch")

    @pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
    def test_interp_all_layers_in_two_launches(dtype, monkeypatch):
        """Layers laid out alike, a constant distance apart: two launches (K, V) for all of them;
        per-layer destinations not equally spaced: one launch per layer and tensor, same values."""
        from contextdeque.kernels import triton_fused

        L, m = 3, 16
        rope, k, v, kf, vf, cos, sin, layers = stacked_layers_case(L, 2, 21, 64, m, dtype)
        launches = []
        real = triton_fused._launch
        monkeypatch.setattr(triton_fused, "_launch", lambda job, *a: (launches.append(a[:1] or (1,)), real(job, *a)))
        out = fused_apply_layers(k, v, rope, cos, sin, kf, vf, backend="triton")
        assert launches == [(L,), (L,)]
        check_layers_against_oracle(out, rope, layers, m, "stacked")
        launches.clear()
        bufs = [torch.empty(1, 2, 21 + 7 * i, 64, dtype=dtype) for i in range(2 * L)]  # unequal sizes
        dests = [ContiguousDest(bufs[2 * i], bufs[2 * i + 1]) for i in range(L)]
        fused_apply_layers(k, v, rope, cos, sin, kf, vf, dests, backend="triton")
        assert launches == [(1,)] * (2 * L)
        check_layers_against_oracle([(d.k[0, :, :21], d.v[0, :, :21]) for d in dests], rope, layers, m, "per layer")

    def test_interp_dot_then_add_path(monkeypatch):
        """The product-from-zero path (taken with "tf32x3" on GPUs) computes the same values."""
        from contextdeque.kernels import triton_fused

        monkeypatch.setitem(triton_fused.LAUNCH_OVERRIDES, "dot_then_add", True)
        rope = RopeSpec("k", 0, 128)
        k, v, kf, vf, cos, sin = make_inputs(2, 21, 128, 32, torch.float32, rope, seed=46)
        _triton_vs_reference(k, v, rope, cos, sin, kf, vf, "triton dot-then-add")

    @pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
    @pytest.mark.parametrize("name", ["partial_rotary_mid", "interleaved_partial", "mla_half", "multi_block"])
    def test_interp_hoist_u_path(dtype, name, monkeypatch):
        """u loaded once per program, every load of a pair before its products (``hoist_u``): the
        same values, with pass-through channels, interleaved pairs, rotation in v and two token blocks."""
        from contextdeque.kernels import triton_fused

        monkeypatch.setitem(triton_fused.LAUNCH_OVERRIDES, "hoist_u", True)
        H, T, d, rope, v_shape = VARIANTS[name]
        k, v, kf, vf, cos, sin = make_inputs(H, T, d, 16, dtype, rope, seed=47, v_shape=v_shape, v_rank=5)
        _triton_vs_reference(k, v, rope, cos, sin, kf, vf, f"triton hoist_u {name}")

    def test_interp_mixed_factor_dtype_and_fp32_out():
        rope = RopeSpec("k", 0, 64)
        k, v, kf, vf, cos, sin = make_inputs(2, 11, 64, 16, torch.bfloat16, rope, seed=45)
        kf32 = (kf[0].float(), kf[1])  # u fp32, w bf16
        tk, tv = run_backend("triton", k, v, rope, cos, sin, kf32, vf, out_dtype=torch.float32)
        assert tk.dtype == torch.float32
        check_against_oracle(tk, tv, k, v, rope, cos, sin, kf32, vf, what="triton mixed")

else:

    def test_triton_kernel_under_interpreter():
        """Runs the ``test_interp_*`` cases in a child process with TRITON_INTERPRET=1."""
        import triton  # noqa: F401 - a test dependency (pyproject [test]): fail loudly if missing

        env = dict(os.environ, CD_KERNELS_INTERP_CHILD="1", TRITON_INTERPRET="1")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", str(Path(__file__)), "-q", "-p", "no:cacheprovider", "-k", "test_interp_"],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=900,
        )
        tail = proc.stdout[-4000:] + proc.stderr[-2000:]
        assert proc.returncode == 0, tail
        m = re.search(r"(\d+) passed", proc.stdout)
        assert m and int(m.group(1)) == N_INTERP_CASES, tail
        assert "failed" not in proc.stdout and "skipped" not in proc.stdout, tail
