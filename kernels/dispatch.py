"""The one entry point the operator calls: fused relocate + patch, written into a destination cache.

Backends (``backend=``):

- ``"auto"`` (default): ``"triton"`` for CUDA tensors when triton imports; otherwise ``"native"``
  on CPU when the C kernel is built (see :mod:`.native`), else ``"torch"``. "auto" never picks
  the Triton interpreter, whatever ``TRITON_INTERPRET`` says: that is a test tool, ask for it
  with ``backend="triton"``.
- ``"triton"``: :mod:`.triton_fused` (CUDA, or CPU under ``TRITON_INTERPRET=1``); a whole chunk
  whose layers are laid out alike is two launches (K, V), not two per layer.
- ``"native"``: the compiled CPU kernel; a job whose strides it does not take runs on ``"torch"``.
- ``"torch"``: :mod:`.torch_path`, any device.
- ``"reference"``: :mod:`.reference`, the slow fp32 oracle.

All backends compute the same thing (fp32 math, one rounding to the destination dtype) and agree
within one unit in the last place of the destination dtype; tests hold them to it.
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence, Union

import torch

from ..core.errors import KernelArgumentError
from . import native, torch_path
from .reference import job_result, write_job
from .spec import ContiguousDest, Dest, Factors, RopeSpec, TensorJob, build_jobs, layer_arg, stacked_factors

Backend = Literal["auto", "triton", "native", "torch", "reference"]
BACKENDS = ("auto", "triton", "native", "torch", "reference")
KV = tuple[torch.Tensor, torch.Tensor]


def select_backend(device: Union[torch.device, str]) -> str:
    """The concrete backend ``"auto"`` uses for tensors on ``device``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        from . import triton_fused

        return "triton" if triton_fused.HAVE_TRITON else "torch"
    if dev.type == "cpu" and native.available():
        return "native"
    return "torch"


def _run(jobs: list[TensorJob], backend: str) -> None:
    if backend not in BACKENDS:
        raise KernelArgumentError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        backend = select_backend(jobs[0].content.device)
    if backend == "reference":
        for job in jobs:
            write_job(job, job_result(job))
    elif backend == "triton":
        from . import triton_fused

        if not triton_fused.available_for(jobs[0].content.device):
            raise KernelArgumentError(
                f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on CPU) and triton installed; "
                f"got {jobs[0].content.device} tensors, triton importable: {triton_fused.HAVE_TRITON}"
            )
        triton_fused.run_jobs(jobs)
    elif backend == "native":
        if not native.available():
            raise KernelArgumentError(f"the native CPU kernel is unavailable: {native.unavailable_reason()}")
        fast, slow = [], []
        for job in jobs:
            (fast if native.supports(job) else slow).append(job)
        if fast:
            native.run_jobs(fast)
        for job in slow:
            torch_path.run_job(job)
    else:
        for job in jobs:
            torch_path.run_job(job)


def _triton_all_layers(k, v, rope, cos, sin, kf, vf, dests, out_k, out_v, L: int) -> bool:
    """All layers in two Triton launches where the layers are laid out alike (see
    :func:`.triton_fused.run_all_layers`); ``False`` when that path does not apply."""
    from . import triton_fused

    if not triton_fused.available_for(layer_arg(k, 0, 3).device):
        return False  # the per-layer path raises the clear error
    return triton_fused.run_all_layers(k, v, rope, cos, sin, kf, vf, dests, out_k, out_v, L)


def _new_dest(k_content: torch.Tensor, v_content: torch.Tensor, out_dtype: Optional[torch.dtype]) -> ContiguousDest:
    def buf(c: torch.Tensor) -> torch.Tensor:
        return torch.empty((1, *c.shape), dtype=out_dtype or c.dtype, device=c.device)

    return ContiguousDest(buf(k_content), buf(v_content))


def fused_apply(
    k_content: torch.Tensor,
    v_content: torch.Tensor,
    rope: Optional[RopeSpec],
    cos: Optional[torch.Tensor],
    sin: Optional[torch.Tensor],
    k_factors: Factors = None,
    v_factors: Factors = None,
    dest: Optional[Dest] = None,
    *,
    out_dtype: Optional[torch.dtype] = None,
    backend: Backend = "auto",
) -> Optional[KV]:
    """Place one layer of a chunk: ``K = R(pos)(K_content + u_K w_K)``, ``V = V_content + u_V w_V``.

    Args:
        k_content: ``[H_k, T, d_k]`` keys in the content frame (fp32/bf16/fp16).
        v_content: ``[H_v, T, d_v]`` values.
        rope: which channels of which tensor rotate (:class:`RopeSpec`), or ``None`` for none.
        cos, sin: ``[T, rope.dim // 2]`` fp32 per-token tables (``None`` when ``rope`` is).
        k_factors, v_factors: patch ``(u [T, m], w [m, H*d])`` per tensor, or ``None`` (rank 0);
            ranks 0..128. Sum several patches by concatenating their factors along ``m``.
        dest: :class:`ContiguousDest` / :class:`PagedDest` to write into (only the chunk's
            positions/slots are touched; it must not overlap the inputs), or ``None``.
        out_dtype: dtype of the new tensors when ``dest`` is ``None`` (default: each content's).
        backend: see the module docstring.

    Returns:
        ``None`` when writing into ``dest``; otherwise new ``(k [H_k, T, d_k], v [H_v, T, d_v])``.
    """
    own = dest is None
    d = _new_dest(k_content, v_content, out_dtype) if own else dest
    jobs = list(build_jobs(k_content, v_content, rope, cos, sin, k_factors, v_factors, d))  # type: ignore[arg-type]
    _run(jobs, backend)
    if own:
        assert isinstance(d, ContiguousDest)
        return d.k[0], d.v[0]
    return None


def reference_apply(
    k_content: torch.Tensor,
    v_content: torch.Tensor,
    rope: Optional[RopeSpec],
    cos: Optional[torch.Tensor],
    sin: Optional[torch.Tensor],
    k_factors: Factors = None,
    v_factors: Factors = None,
    dest: Optional[Dest] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> Optional[KV]:
    """The slow fp32 oracle for one layer: :func:`fused_apply` with ``backend="reference"``."""
    return fused_apply(k_content, v_content, rope, cos, sin, k_factors, v_factors, dest, out_dtype=out_dtype, backend="reference")


def _check_layers(arg, name: str, L: int, stacked_dim: int) -> None:
    """A per-layer argument must provide exactly L layers (stacked, or as a sequence)."""
    if arg is None:
        return
    if isinstance(arg, torch.Tensor):
        if arg.dim() != stacked_dim + 1 and (stacked_dim == 3 or arg.dim() != stacked_dim):
            raise KernelArgumentError(f"{name} must be stacked [L, ...] or a per-layer sequence, got {tuple(arg.shape)}")
        counts = [arg.shape[0]] if arg.dim() == stacked_dim + 1 else []  # else: one table for all layers
    elif stacked_factors(arg):
        counts = [arg[0].shape[0], arg[1].shape[0]]
    else:
        counts = [len(arg)]
    for n in counts:
        if n != L:
            raise KernelArgumentError(f"{name} has {n} entries for {L} layers")


def fused_apply_layers(
    k_contents: Union[torch.Tensor, Sequence[torch.Tensor]],
    v_contents: Union[torch.Tensor, Sequence[torch.Tensor]],
    rope: Optional[RopeSpec],
    cos: Union[None, torch.Tensor, Sequence[torch.Tensor]],
    sin: Union[None, torch.Tensor, Sequence[torch.Tensor]],
    k_factors: Union[None, tuple[torch.Tensor, torch.Tensor], Sequence[Factors]] = None,
    v_factors: Union[None, tuple[torch.Tensor, torch.Tensor], Sequence[Factors]] = None,
    dests: Optional[Sequence[Dest]] = None,
    *,
    out_dtype: Optional[torch.dtype] = None,
    backend: Backend = "auto",
) -> Optional[list[KV]]:
    """:func:`fused_apply` for all L layers of a chunk at once (one kernel call on CPU).

    Args:
        k_contents, v_contents: stacked ``[L, H, T, d]`` tensors, or sequences of L ``[H, T, d]``.
        cos, sin: one ``[T, rope.dim // 2]`` table shared by all layers, per-layer tables stacked
            ``[L, T, rope.dim // 2]`` or as a sequence (per-layer RoPE bases), or ``None``.
        k_factors, v_factors: ``None``; a stacked pair ``(u [L, T, m], w [L, m, H*d])``; or a
            sequence of L per-layer pairs / ``None`` (e.g. deep-only patches).
        dests: a sequence of L :class:`ContiguousDest` / :class:`PagedDest`, or ``None``.

    Returns ``None`` when writing into ``dests``, else a list of new ``(k, v)`` per layer.

    When every layer is laid out alike (same shapes, strides and dtypes; destinations of one
    layout, e.g. a per-layer HF cache, or a paged cache's layers sharing one slot mapping), the
    native backend checks layer 0 in full and the others only for that likeness, and runs all
    layers in one call; the Triton backend likewise, in two launches, when each layer's tensors
    also lie a constant distance apart (stacked tensors or views of them). Stacked tensors make
    that check cheapest.
    """
    L = k_contents.shape[0] if isinstance(k_contents, torch.Tensor) else len(k_contents)
    if L == 0:
        raise KernelArgumentError("fused_apply_layers needs at least one layer")
    for name, arg, dim in (
        ("k_contents", k_contents, 3),
        ("v_contents", v_contents, 3),
        ("k_factors", k_factors, 2),
        ("v_factors", v_factors, 2),
        ("cos", cos, 2),
        ("sin", sin, 2),
        ("dests", dests, 0),
    ):
        _check_layers(arg, name, L, dim)

    own = dests is None
    out_k = out_v = None
    if own:
        k0, v0 = layer_arg(k_contents, 0, 3), layer_arg(v_contents, 0, 3)
        out_k = torch.empty((L, 1, *k0.shape), dtype=out_dtype or k0.dtype, device=k0.device)
        out_v = torch.empty((L, 1, *v0.shape), dtype=out_dtype or v0.dtype, device=v0.device)
    chosen = select_backend(layer_arg(k_contents, 0, 3).device) if backend == "auto" else backend
    if chosen == "native" and native.available() and native.run_all_layers(
        k_contents, v_contents, rope, cos, sin, k_factors, v_factors, dests, out_k, out_v, L
    ):
        pass
    elif chosen == "triton" and _triton_all_layers(
        k_contents, v_contents, rope, cos, sin, k_factors, v_factors, dests, out_k, out_v, L
    ):
        pass
    else:
        jobs: list[TensorJob] = []
        for i in range(L):
            d = ContiguousDest(out_k[i], out_v[i]) if own else dests[i]  # type: ignore[index]
            jobs.extend(
                build_jobs(
                    layer_arg(k_contents, i, 3), layer_arg(v_contents, i, 3), rope, layer_arg(cos, i, 2),
                    layer_arg(sin, i, 2), layer_arg(k_factors, i, 2), layer_arg(v_factors, i, 2), d,
                )
            )
        _run(jobs, chosen)
    if own:
        return [(out_k[i, 0], out_v[i, 0]) for i in range(L)]  # type: ignore[index]
    return None
