"""Kernel arguments, backend dispatch, imports without triton or a compiler, the portable native
builds, the Triton launch's precision choice and the bench helper."""

from __future__ import annotations

import ast
import math
import os
import subprocess
import sys

import pytest
import torch

from contextdeque.core.errors import EmptyChunkError, KernelArgumentError, PatchError, PositionError, StorageDtypeError
from contextdeque.kernels import (
    ContiguousDest,
    PagedDest,
    RopeSpec,
    fused_apply,
    select_backend,
)
from contextdeque.kernels import native
from contextdeque.kernels.spec import build_jobs
from kernel_oracle import (
    REPO,
    make_inputs,
)


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
        "import kernel_oracle as t\n"
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
