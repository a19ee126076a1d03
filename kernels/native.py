"""Native CPU backend: the fused kernel of ``csrc/cd_fused.c``, compiled on first use, called via
ctypes; the marshalling of tensors into its parameter blocks lives here too.

Why a C kernel. On CPU the apply is one memory pass plus a skinny GEMM (``[T, m] @ [m, H*d]``).
torch can only express it as separate ops, each a pass over memory with fp32 temporaries (the
``"torch"`` backend: 2-3x the floor in fp32, up to 15x in bf16 at rank 0, where every op converts).
torch.compile (inductor C++) was the other option; it leaves the skinny GEMM to an external MKL
call with a separate epilogue pass, recompiles per chunk length, and needs seconds to compile per
shape. This kernel reads the content once, forms the rank-m product per tile of 48 tokens in
registers (fp32 FMA, or ``vdpbf16ps`` for bf16 factors: exact bf16 products, fp32 sums, twice
the rate), rotates in L1, rounds once and writes the destination once (~600 lines of C).

Where the time goes (2 cores of a shared AMD EPYC VM with AVX-512 + AVX512-BF16; SmolLM2-135M
shape: 30 layers, 3 KV heads, d=64, half-split rotation of all 64 dims; T=1024; every timed call
starts from a cold cache; ``bench_util``):

- rank 0 is a memory pass. V rows are plain copies; K rows are load, rotate, round, store
  (~3-5 ns per 64-channel row per core when cached). The kernel alone runs at the speed of a
  flat ``copy_`` of the same bytes (bf16: 1.28 ms vs 1.21 ms) because (i) each token's cos/sin
  row is read once for all heads (token-major order), (ii) a call whose footprint exceeds the
  last-level cache writes with streaming stores (no read-for-ownership of the destination),
  (iii) all layers go in one call (``fused_apply_layers``: one thread-team fork). What remains
  is Python: checking and addressing 30 layers takes ~70 us with warm caches, ~250-350 us cold.
  Measured apply/memcpy: fp32 1.11-1.16, bf16 1.44-1.50 (1.05 when caches are warm).
- rank 32 is compute-bound: 2*T*m*H*d flops per tensor (0.75 GFLOP per chunk). The product runs
  close to FMA throughput (6 tokens x 64 channels of accumulators in registers; bf16 factors use
  ``vdpbf16ps``, twice the rate) and the memory pass overlaps it: apply/GEMM floor 0.60-0.83
  (fp32) and 0.74-0.81 (bf16), i.e. faster than ``addmm`` alone.
- the pure-torch backend is 2-3x the floor (fp32) and 3-15x (bf16); ``fused_apply`` called per
  layer (30 calls) costs 1.1-1.7x ``fused_apply_layers`` at rank 0 (per-call checks and forks).

Build. The source (``kernels/csrc/cd_fused.c``, shipped as package data) is compiled with the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``)
with ``-O3 -march=native -fopenmp`` (AVX-512, AVX2+F16C and plain C code paths; the tests build
the latter two with ``CONTEXTDEQUE_NATIVE_MARCH``) into ``$CONTEXTDEQUE_KERNEL_CACHE`` (default
``$XDG_CACHE_HOME/contextdeque/kernels``), keyed by a hash of source, flags and CPU (not the
compiler: a populated cache works without one), written atomically (~4 s, once). Its OpenMP
runtime resolves to the ``libgomp.so.1`` torch already loaded, so both share one thread pool; calls
too small to amortize a fork run on one thread. If anything fails (no compiler, read-only cache,
odd platform), :func:`available` is ``False`` with the reason in :func:`unavailable_reason` and
the dispatcher uses the torch path. ``CONTEXTDEQUE_NATIVE=0`` disables it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .spec import LayerMismatch, TensorJob, dest_addresses, factor_addresses, layer0_jobs, layer_addresses

#: The kernel's C source, shipped as package data beside this module.
SOURCE_PATH = Path(__file__).resolve().parent / "csrc" / "cd_fused.c"

_DT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _flags() -> list[str]:
    # CONTEXTDEQUE_NATIVE_MARCH picks another target (e.g. "haswell", "x86-64"): the tests use it
    # to check the AVX2 and generic code paths on an AVX-512 machine
    march = os.environ.get("CONTEXTDEQUE_NATIVE_MARCH", "native")
    return ["-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-Wno-psabi"]

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_reason: Optional[str] = None
_tried = False


def _cache_dir() -> Path:
    env = os.environ.get("CONTEXTDEQUE_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "contextdeque" / "kernels"


def _compiler() -> Optional[str]:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def _cpu_signature() -> str:
    # -march=native output depends on the CPU: key the cache on its feature flags
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _build() -> ctypes.CDLL:
    # The key ignores the compiler: any successful build of this source with these flags for this
    # CPU is equally valid, so a populated cache works on machines without a compiler.
    flags = _flags()
    source = SOURCE_PATH.read_text()
    key = hashlib.sha256("\0".join([source, " ".join(flags), platform.machine(), _cpu_signature()]).encode())
    target = _cache_dir() / f"cd_fused_{key.hexdigest()[:24]}.so"
    if not target.exists():
        cc = _compiler()
        if cc is None:
            raise RuntimeError("no C compiler found (set $CC) and no cached build")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / "cd_fused.c"
            src.write_text(source)
            so = Path(tmp) / "cd_fused.so"
            proc = subprocess.run([cc, *flags, str(src), "-o", str(so)], capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"compiling the native kernel failed: {proc.stderr.strip()[-2000:]}")
            os.replace(so, target)  # atomic: concurrent builders each install a complete file
    lib = ctypes.CDLL(str(target))
    lib.cd_apply_many.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    lib.cd_apply_many.restype = ctypes.c_int
    lib.cd_param_count.restype = ctypes.c_int
    if lib.cd_param_count() != _N_PARAMS:
        raise RuntimeError("native kernel parameter layout does not match this module")
    return lib


def _load() -> Optional[ctypes.CDLL]:
    global _lib, _reason, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("CONTEXTDEQUE_NATIVE", "1") == "0":
                _reason = "disabled by CONTEXTDEQUE_NATIVE=0"
            elif platform.system() != "Linux":
                _reason = f"native kernel is built only on Linux (this is {platform.system()})"
            else:
                try:
                    _lib = _build()
                except Exception as exc:  # any failure means: use the torch path
                    _reason = f"{type(exc).__name__}: {exc}"
            _tried = True
    return _lib


def available() -> bool:
    """Whether the native kernel is compiled and loaded (builds it on the first call)."""
    return _load() is not None


def vector_width() -> int:
    """fp32 lanes per vector of the loaded build (16 with AVX-512, 8 otherwise); 0 if unavailable."""
    lib = _load()
    return int(lib.cd_vector_width()) if lib is not None else 0


def unavailable_reason() -> Optional[str]:
    """Why :func:`available` is ``False`` (``None`` when it is available or not tried yet)."""
    _load()
    return _reason


_N_PARAMS = 29
_DT_SIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def supports(job: TensorJob) -> bool:
    """Whether the native kernel can run this job as laid out (CPU, unit channel strides)."""
    return job.content.device.type == "cpu" and job.unit_channel_strides()


def _params(job: TensorJob) -> list[int]:
    # keep in sync with the P_* enum of the C source
    c = job.content
    H, T, D = c.shape
    p = [c.data_ptr(), c.stride(0), c.stride(1), H, T, D, _DT_CODE[c.dtype]]
    u, w = job.u, job.w
    if u is not None and w is not None:
        p += [u.data_ptr(), u.stride(0), u.shape[1], _DT_CODE[u.dtype], w.data_ptr(), w.stride(0), _DT_CODE[w.dtype]]
    else:
        p += [0, 0, 0, 0, 0, 0, 0]
    if job.half and job.cos is not None and job.sin is not None:
        p += [job.cos.data_ptr(), job.sin.data_ptr(), job.half, job.rope_start, job.half, int(job.interleaved)]
    else:
        p += [0, 0, 0, 0, 0, 0]
    buf = job.buf
    dt = buf.dtype
    if job.slots is None:
        s0, s1, s2, _ = buf.stride()
        base = buf.data_ptr() + (job.batch * s0 + job.start * s2) * _DT_SIZE[dt]
        p += [base, s1, s2, _DT_CODE[dt], 0, 0, 0, 0, 0]
    else:
        nb, bs = buf.shape[0], buf.shape[1]
        s0, s1, s2, _ = buf.stride()
        p += [buf.data_ptr(), s2, 0, _DT_CODE[dt], job.slots.data_ptr(), bs, s0, s1, nb * bs]
    return p


def _last_level_cache_bytes() -> int:
    for index in range(4, 0, -1):  # the highest cache level the kernel reports
        try:
            text = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        try:
            return int(text.rstrip("KMGkmg")) * scale
        except ValueError:
            continue
    return 32 << 20


#: A call whose footprint (bytes read + written) exceeds the last-level cache writes with
#: streaming (non-temporal) stores: its output could not stay in cache anyway, and skipping the
#: destinations' read-for-ownership saves a third of the memory traffic. Smaller calls keep
#: normal stores, so the next reader (attention) finds their output in cache.
STREAM_MIN_BYTES = _last_level_cache_bytes()


def _call(params: np.ndarray, njobs: int, footprint: int) -> None:
    """``params``: C-contiguous int64 ``[njobs, _N_PARAMS]``; ``footprint``: bytes read + written."""
    lib = _lib
    assert lib is not None
    if lib.cd_apply_many(params.ctypes.data, njobs, torch.get_num_threads(), int(footprint > STREAM_MIN_BYTES)) != 0:
        raise MemoryError("native kernel could not allocate its scratch buffers")


def run_jobs(jobs: list[TensorJob]) -> None:
    """Run checked tensor jobs in one native call (caller checked :func:`available`/:func:`supports`).

    The destinations must not overlap the inputs or each other.
    """
    footprint = sum(job.content.numel() * (job.content.element_size() + _DT_SIZE[job.buf.dtype]) for job in jobs)
    _call(np.array([_params(job) for job in jobs], dtype=np.int64), len(jobs), footprint)


# byte-address fields of a parameter block (the P_* enum of the C source)
_ADDRESS_FIELDS = (0, 7, 11, 14, 15, 20)  # content, u, w, cos, sin, destination


def run_layers(jobs0: tuple[TensorJob, TensorJob], *, k: tuple[list[int], ...], v: tuple[list[int], ...]) -> None:
    """All layers of a chunk in one call, from the checked jobs of layer 0.

    ``k`` / ``v``: per-layer data addresses ``(content, u, w, cos, sin, destination)`` of tensors
    laid out exactly like layer 0's (the caller checked that); layer ``l`` runs layer 0's
    parameters with those addresses (a destination keeps layer 0's offset into its tensor).
    """
    blocks = []
    footprint = 0
    for job, addrs in ((jobs0[0], k), (jobs0[1], v)):
        p0 = _params(job)
        rows = np.tile(np.array(p0, dtype=np.int64), (len(addrs[0]), 1))
        for f, a in zip(_ADDRESS_FIELDS, addrs):
            if p0[f]:  # keep layer 0's offset from the tensor's data address (destination views)
                base = job.buf.data_ptr() if f == 20 else a[0]
                rows[:, f] = np.array(a, dtype=np.int64) + (p0[f] - base)
        blocks.append(rows)
        footprint += job.content.numel() * (job.content.element_size() + _DT_SIZE[job.buf.dtype]) * len(addrs[0])
    _call(np.ascontiguousarray(np.concatenate(blocks)), 2 * len(k[0]), footprint)


def run_all_layers(k, v, rope, cos, sin, kf, vf, dests, out_k, out_v, L: int) -> bool:
    """Native path for many layers laid out alike: layer 0 is checked in full, the other layers
    only for having the same shapes, strides, dtypes and devices; then one kernel call.

    Returns ``False`` (nothing written) when the layers differ, to use the per-layer path."""
    own = dests is None
    jobs0 = layer0_jobs(k, v, rope, cos, sin, kf, vf, dests, out_k, out_v)
    if not all(supports(j) for j in jobs0):
        return False
    try:
        if own:
            d_k, d_v = layer_addresses(out_k, L, 4, out_k[0]), layer_addresses(out_v, L, 4, out_v[0])
        else:
            addresses = dest_addresses(dests)
            if addresses is None:
                raise LayerMismatch
            d_k, d_v = addresses
        jk, jv = jobs0
        per_tensor = []
        for job, content, f, dest in ((jk, k, kf, d_k), (jv, v, vf, d_v)):
            u, w = factor_addresses(f, L, job)
            if job.half:
                c, s_ = layer_addresses(cos, L, 2, job.cos), layer_addresses(sin, L, 2, job.sin)  # type: ignore[arg-type]
            else:
                c = s_ = [0] * L
            per_tensor.append((layer_addresses(content, L, 3, job.content), u, w, c, s_, dest))
        run_layers(jobs0, k=per_tensor[0], v=per_tensor[1])
    except LayerMismatch:
        return False
    return True
