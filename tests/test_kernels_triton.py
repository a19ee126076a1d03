"""The Triton kernel on CPU under ``TRITON_INTERPRET=1``, against the reference backend and the
float64 oracle (``kernel_oracle``).

The Triton kernel runs on CPU under ``TRITON_INTERPRET=1`` in a child pytest process (the
interpreter is chosen when triton decorates the kernel, i.e. at import, so it cannot be switched on
inside a process that imported the kernel already); the parent checks the child ran every case.
"""

from __future__ import annotations

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

from contextdeque.kernels import (  # noqa: E402
    ContiguousDest, PagedDest, RopeSpec, fused_apply, fused_apply_layers, select_backend, slot_mapping_from_block_table,
)
from kernel_oracle import (  # noqa: E402
    DTYPES,
    HEAD_DIMS,
    RANKS,
    REPO,
    VARIANTS,
    _rank,
    assert_ulp_close,
    check_against_oracle,
    check_layers_against_oracle,
    make_inputs,
    oracle,
    run_backend,
    stacked_layers_case,
)

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
