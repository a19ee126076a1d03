"""The kernels' independent float64 oracle, its tolerance and the shared cases: every kernel test
(``test_kernels*.py``, ``test_cuda.py``) checks a backend against these.

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
"""

from __future__ import annotations

from pathlib import Path

import torch

from contextdeque.kernels import RopeSpec, fused_apply

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
