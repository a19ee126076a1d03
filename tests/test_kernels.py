"""The CPU kernels (native C, torch, reference) against the float64 oracle (``kernel_oracle``):
head dims, ranks, layouts, dtypes, strides and destinations."""

from __future__ import annotations

import pytest
import torch

from contextdeque.core.errors import PositionError
from contextdeque.kernels import (
    ContiguousDest,
    PagedDest,
    RopeSpec,
    fused_apply,
    reference_apply,
    slot_mapping_from_block_table,
)
from contextdeque.kernels import native
from kernel_oracle import (
    CPU_BACKENDS,
    DTYPES,
    HEAD_DIMS,
    RANKS,
    VARIANTS,
    assert_ulp_close,
    check_against_oracle,
    make_inputs,
    oracle,
    rope_tables,
    run_backend,
    ulp,
)


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
