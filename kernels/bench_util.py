"""Timing helpers for ``contextdeque bench``: the fused apply against its roofline floors.

For a model shape (layers, KV heads, head dim, rank) and a chunk of T tokens:

- **memcpy floor**: one flat ``copy_`` of as many bytes as the apply reads (content K+V of every
  layer) into as many as it writes (the destination); also reported: the same bytes copied
  tensor by tensor (``dest.copy_(content)``, 2L calls), which carries the per-call costs the
  apply carries too;
- **GEMM floor**: per layer and tensor, ``torch.addmm(content, u, w, out=dest)`` over the same
  buffers -- the rank-m factor products alone, with the add folded in (rank 0: not defined);
- **floor** = max(memcpy, GEMM); the target is apply <= 1.5x floor (rank 0: <= 1.5x memcpy);
- **true floor** (with ``ceilings``, see :func:`measure_ceilings`): the bytes the apply must move
  (contents and factors read, destinations written, the tables once) over the device's measured
  copy bandwidth, or its FLOPs over a large GEMM's measured rate, whichever is larger. On a GPU
  the per-shape floors above carry launch costs of their own (60 ``addmm`` calls), so this is
  the floor the GPU target is held to.

On CUDA every call is timed with CUDA events (from the call's start to the end of the work it
enqueued: host checks and launches included, warm-up first, so compilation stays out) and the
cache flush rewrites a buffer twice the L2; the apply is also timed as a CUDA-graph replay
(:func:`device_time`: the kernels alone, without the host's share).

Every timed call starts from a cold cache (a buffer twice the last-level cache is rewritten
before it, untimed), as a chunk fetched from a store would. Timing on shared machines is noisy,
so all are measured in interleaved rounds and the minimum per method is reported (the best
estimate of the uncontended time), with the median beside it. Nothing here asserts a
threshold: callers report.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from .dispatch import Backend, fused_apply, fused_apply_layers
from .native import _last_level_cache_bytes
from .spec import ContiguousDest, RopeSpec

#: SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, half-split rotation of all 64 dims.
SMOLLM2_135M = dict(layers=30, heads=3, head_dim=64)


@dataclass
class ApplyCase:
    """Inputs and destinations of a whole-chunk apply (see :func:`make_case`).

    Contents and factors are stacked over layers (``k [L, H, T, d]``, ``k_factors = (u [L, T, m],
    w [L, m, H*d])``), the layout :func:`fused_apply_layers` handles fastest; ``dests`` holds one
    contiguous ``[1, H, T, d]`` destination per layer (views of one stacked buffer per tensor).
    """

    tokens: int
    rank: int
    dtype: torch.dtype
    rope: RopeSpec
    cos: torch.Tensor
    sin: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_factors: Optional[tuple[torch.Tensor, torch.Tensor]]
    v_factors: Optional[tuple[torch.Tensor, torch.Tensor]]
    dests: list[ContiguousDest] = field(default_factory=list)

    @property
    def layers(self) -> int:
        return self.k.shape[0]

    @property
    def bytes_moved(self) -> int:
        """The fewest bytes the apply must move: contents and factors read, destinations written,
        the cos/sin tables read once."""
        factors = sum(
            t.numel() * t.element_size() for f in (self.k_factors, self.v_factors) if f is not None for t in f
        )
        tables = sum(t.numel() * t.element_size() for t in (self.cos, self.sin))
        return self.bytes_read + self.bytes_written + factors + tables

    @property
    def flops(self) -> int:
        """Multiply-add FLOPs of the rank-m products: ``2 T m H d`` per layer and tensor."""
        return sum(2 * self.rank * t.numel() for t in (self.k, self.v))  # t: [L, H, T, d]

    def layer_factors(self, i: int) -> tuple:
        """``(k_factors, v_factors)`` of layer ``i`` (pairs of views, or ``None``)."""
        kf, vf = self.k_factors, self.v_factors
        return (None if kf is None else (kf[0][i], kf[1][i])), (None if vf is None else (vf[0][i], vf[1][i]))

    @property
    def bytes_read(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v))

    @property
    def bytes_written(self) -> int:
        return sum(d.k.numel() * d.k.element_size() + d.v.numel() * d.v.element_size() for d in self.dests)


def make_case(
    tokens: int,
    *,
    layers: int = 30,
    heads: int = 3,
    head_dim: int = 64,
    rank: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: "torch.device | str" = "cpu",
) -> ApplyCase:
    """Random content, rank-``rank`` factors on K and V, fp32 tables and a contiguous destination
    ``[1, heads, tokens, head_dim]`` per layer (full half-split rotation of K), on ``device``.

    The destinations are per-layer views of one ``[L, 1, heads, tokens, head_dim]`` buffer per
    tensor, the layout the operator's own outputs have (one kernel call for all layers on CPU,
    two launches on CUDA)."""
    g = torch.Generator().manual_seed(seed)
    rope = RopeSpec("k", 0, head_dim)
    pos = torch.arange(tokens, dtype=torch.float32) + 1000.0
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = pos[:, None] * inv_freq[None, :]

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)

    def factors() -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        if not rank:
            return None
        return rnd(layers, tokens, rank), rnd(layers, rank, heads * head_dim, scale=0.1)

    case = ApplyCase(
        tokens, rank, dtype, rope, torch.cos(ang).to(device), torch.sin(ang).to(device),
        k=rnd(layers, heads, tokens, head_dim), v=rnd(layers, heads, tokens, head_dim),
        k_factors=factors(), v_factors=factors(),
    )
    out_k = torch.empty(layers, 1, heads, tokens, head_dim, dtype=dtype, device=device)
    out_v = torch.empty(layers, 1, heads, tokens, head_dim, dtype=dtype, device=device)
    case.dests.extend(ContiguousDest(out_k[i], out_v[i]) for i in range(layers))
    return case


def memcpy_fn(case: ApplyCase) -> Callable[[], None]:
    """One flat copy of ``bytes_read`` bytes onto a buffer of the same size (the memory floor)."""
    n = case.bytes_read // 2  # int16 elements: a dtype-agnostic byte copy
    src = torch.ones(n, dtype=torch.int16, device=case.k.device)
    dst = torch.empty(n, dtype=torch.int16, device=case.k.device)
    return lambda: dst.copy_(src)


def memcpy_per_tensor_fn(case: ApplyCase) -> Callable[[], None]:
    """``dest.copy_(content)`` per layer and tensor: the same copies the apply makes, without math."""
    pairs = [(d.k[0], case.k[i]) for i, d in enumerate(case.dests)] + [(d.v[0], case.v[i]) for i, d in enumerate(case.dests)]

    def run() -> None:
        for dst, src in pairs:
            dst.copy_(src)

    return run


def gemm_fn(case: ApplyCase) -> Optional[Callable[[], None]]:
    """Per layer and tensor ``addmm(content, u, w, out=dest)`` on the case's own buffers (``None`` at rank 0)."""
    if not case.rank:
        return None
    T = case.tokens
    ops = []
    for i, d in enumerate(case.dests):
        kf, vf = case.layer_factors(i)
        for c, f, o in ((case.k[i], kf, d.k), (case.v[i], vf, d.v)):
            hd = c.shape[0] * c.shape[2]
            # the content reinterpreted as [T, H*d]: same bytes and FLOPs as the real apply
            ops.append((c.view(T, hd), f[0], f[1], o.view(T, hd)))

    def run() -> None:
        for c, u, w, o in ops:
            torch.addmm(c, u, w, out=o)

    return run


def apply_fn(case: ApplyCase, backend: Backend = "auto", per_layer: bool = False) -> Callable[[], None]:
    """The fused apply of every layer into the case's destinations: one ``fused_apply_layers``
    call on the stacked inputs, or (``per_layer=True``) one ``fused_apply`` per layer."""
    if per_layer:
        args = [(case.k[i], case.v[i], *case.layer_factors(i), case.dests[i]) for i in range(case.layers)]

        def run_layers() -> None:
            for k, v, kf, vf, d in args:
                fused_apply(k, v, case.rope, case.cos, case.sin, kf, vf, d, backend=backend)

        return run_layers

    def run() -> None:
        fused_apply_layers(
            case.k, case.v, case.rope, case.cos, case.sin, case.k_factors, case.v_factors, case.dests, backend=backend
        )

    return run


@dataclass
class Timing:
    min_s: float
    median_s: float


def _flush_buffer(device: torch.device) -> torch.Tensor:
    """A buffer twice the last-level cache of ``device`` (the L2 on CUDA)."""
    if device.type == "cuda":
        llc = torch.cuda.get_device_properties(device).L2_cache_size
    else:
        llc = _last_level_cache_bytes()
    return torch.empty(2 * llc // 4, dtype=torch.float32, device=device)


def time_interleaved(
    fns: dict[str, Callable[[], None]],
    rounds: int = 30,
    warmup: int = 2,
    flush: bool = True,
    device: "torch.device | str" = "cpu",
) -> dict[str, Timing]:
    """Time each function once per round, rounds interleaved; min and median seconds per function.

    With ``flush`` every timed call starts from a cold cache (a buffer twice the last-level cache
    is rewritten first, untimed): otherwise a function would profit from data the previous one
    left in cache, and the order of the functions would bias the comparison. On CUDA each call
    is bracketed by CUDA events (the device time of what it enqueued, the launch gaps included).
    """
    dev = torch.device(device)
    scratch = _flush_buffer(dev) if flush else None
    for _ in range(warmup):
        for f in fns.values():
            f()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    if dev.type == "cuda":
        events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {k: [] for k in fns}
        for _ in range(rounds):
            for name, f in fns.items():
                if scratch is not None:
                    scratch.fill_(1.0)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                f()
                end.record()
                events[name].append((start, end))
        torch.cuda.synchronize(dev)
        samples = {k: [a.elapsed_time(b) / 1e3 for a, b in v] for k, v in events.items()}
    else:
        for _ in range(rounds):
            for name, f in fns.items():
                if scratch is not None:
                    scratch.fill_(1.0)
                t0 = time.perf_counter()
                f()
                samples[name].append(time.perf_counter() - t0)
    return {k: Timing(min(v), statistics.median(v)) for k, v in samples.items()}


def device_time(fn: Callable[[], None], device: "torch.device | str", rounds: int = 20) -> Optional[Timing]:
    """The device time of the work ``fn`` enqueues, without its host costs (argument checks,
    launches): ``fn`` captured once into a CUDA graph whose replays are timed with events, each
    from a cold L2. ``None`` off CUDA. ``fn`` must only launch work (no allocation, no sync)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_interleaved({"graph": graph.replay}, rounds=rounds, device=dev)["graph"]


@dataclass
class Ceilings:
    """A device's measured ceilings: copy bandwidth (bytes read + written per second) and the
    rate of a large GEMM per storage dtype (FLOP/s)."""

    device: str
    copy_bytes_per_s: float
    gemm_flops_per_s: dict[str, float]

    def floor_s(self, case: "ApplyCase") -> float:
        """The true floor of ``case``'s apply: max(bytes moved / bandwidth, FLOPs / GEMM rate)."""
        rate = self.gemm_flops_per_s.get(str(case.dtype).replace("torch.", ""))
        compute = case.flops / rate if rate and case.flops else 0.0
        return max(case.bytes_moved / self.copy_bytes_per_s, compute)


def copy_bandwidth(nbytes: int, device: "torch.device | str" = "cpu", repeats: int = 5) -> float:
    """Measured bytes/s (read + written) of one ``copy_`` of ``nbytes`` on ``device`` (best of ``repeats``)."""
    dev = torch.device(device)
    n = max(1, nbytes // 4)
    src, dst = torch.randn(n, device=dev), torch.empty(n, device=dev)
    t = time_interleaved({"copy": lambda: dst.copy_(src)}, rounds=repeats, warmup=1, flush=False, device=dev)
    return 2 * n * 4 / t["copy"].min_s


def gemm_rate(dtype: torch.dtype, device: "torch.device | str" = "cpu", size: int = 8192, repeats: int = 5) -> float:
    """Measured FLOP/s of a ``size``-cubed ``dtype`` matrix product on random data (best of ``repeats``)."""
    dev = torch.device(device)
    a, b = torch.randn(size, size, device=dev).to(dtype), torch.randn(size, size, device=dev).to(dtype)
    out = torch.empty(size, size, device=dev, dtype=dtype)
    t = time_interleaved({"gemm": lambda: torch.mm(a, b, out=out)}, rounds=repeats, warmup=1, flush=False, device=dev)
    return 2 * size**3 / t["gemm"].min_s


def measure_ceilings(
    device: "torch.device | str", dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16), copy_bytes: int = 4 << 30,
    gemm_size: int = 8192,
) -> Ceilings:
    """Measure the copy bandwidth (``copy_bytes`` copied) and each dtype's GEMM rate on ``device``
    (GPU sizes by default: several times the L2; pass smaller ones on CPUs)."""
    dev = torch.device(device)
    return Ceilings(
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        copy_bytes_per_s=copy_bandwidth(copy_bytes, dev),
        gemm_flops_per_s={str(dt).replace("torch.", ""): gemm_rate(dt, dev, gemm_size) for dt in dtypes},
    )


@dataclass
class BenchResult:
    """One bench row; times in seconds (min over rounds), ``ratio = apply / floor``."""

    tokens: int
    rank: int
    dtype: str
    threads: int
    memcpy_s: float
    memcpy_per_tensor_s: float
    gemm_s: Optional[float]
    apply_s: float
    floor_s: float
    ratio: float
    apply_median_s: float
    memcpy_median_s: float
    gemm_median_s: Optional[float]
    bytes_read: int
    backend: str
    bytes_moved: int = 0
    flops: int = 0
    true_floor_s: Optional[float] = None
    true_ratio: Optional[float] = None
    apply_device_s: Optional[float] = None
    device_ratio: Optional[float] = None

    def as_dict(self) -> dict:
        return asdict(self)


def bench_apply(
    tokens: int,
    *,
    rank: int = 32,
    dtype: torch.dtype = torch.float32,
    layers: int = 30,
    heads: int = 3,
    head_dim: int = 64,
    backend: Backend = "auto",
    per_layer: bool = False,
    rounds: int = 30,
    device: "torch.device | str" = "cpu",
    ceilings: Optional[Ceilings] = None,
) -> BenchResult:
    """Time apply vs its floors for one shape (defaults: SmolLM2-135M, rank 32) on ``device``;
    with ``ceilings`` also vs the true floor; see the module doc."""
    from .dispatch import select_backend

    case = make_case(tokens, layers=layers, heads=heads, head_dim=head_dim, rank=rank, dtype=dtype, device=device)
    fns: dict[str, Callable[[], None]] = {
        "memcpy": memcpy_fn(case),
        "memcpy_per_tensor": memcpy_per_tensor_fn(case),
        "apply": apply_fn(case, backend, per_layer),
    }
    g = gemm_fn(case)
    if g is not None:
        fns["gemm"] = g
    t = time_interleaved(fns, rounds=rounds, device=device)
    gemm = t["gemm"].min_s if "gemm" in t else None
    true_floor = ceilings.floor_s(case) if ceilings is not None else None
    on_device = device_time(fns["apply"], device, rounds)
    floor = max(t["memcpy"].min_s, gemm or 0.0)
    return BenchResult(
        tokens=tokens,
        rank=rank,
        dtype=str(dtype).replace("torch.", ""),
        threads=torch.get_num_threads(),
        memcpy_s=t["memcpy"].min_s,
        memcpy_per_tensor_s=t["memcpy_per_tensor"].min_s,
        gemm_s=gemm,
        apply_s=t["apply"].min_s,
        floor_s=floor,
        ratio=t["apply"].min_s / floor,
        apply_median_s=t["apply"].median_s,
        memcpy_median_s=t["memcpy"].median_s,
        gemm_median_s=t["gemm"].median_s if "gemm" in t else None,
        bytes_read=case.bytes_read,
        backend=select_backend(device) if backend == "auto" else backend,
        bytes_moved=case.bytes_moved,
        flops=case.flops,
        true_floor_s=true_floor,
        true_ratio=t["apply"].min_s / true_floor if true_floor else None,
        apply_device_s=on_device.min_s if on_device else None,
        device_ratio=on_device.min_s / true_floor if on_device and true_floor else None,
    )
