"""Argument types shared by every backend of the fused relocate+patch kernel, and their checks.

Everything a backend needs is validated here once (shapes, dtypes, devices, channel strides,
placement bounds), so the backends only compute. Shapes use the core conventions:

- content ``k [H_k, T, d_k]``, ``v [H_v, T, d_v]`` (content frame: RoPE part un-rotated);
- ``RopeSpec``: channels ``[start, start + dim)`` of tensor ``"k"`` (MHA/GQA) or ``"v"`` (MLA's k_pe)
  rotate; half-split pairs channel ``i`` with ``i + dim/2``, interleaved pairs ``2i`` with ``2i+1``;
- cos/sin ``[T, dim/2]`` fp32; ``rotated = (x1*cos - x2*sin, x2*cos + x1*sin)``;
- patch factors ``(u [T, m], w [m, H*d])``; the delta is ``(u @ w).view(T, H, d).transpose(0, 1)``.
  Several patches on one tensor are one patch of the concatenated rank (``cat(u_i, 1)``,
  ``cat(w_i, 0)``), so backends take a single pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch

from ..core.errors import EmptyChunkError, KernelArgumentError, PatchError, PositionError, StorageDtypeError

#: Storage / destination dtypes every backend supports.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Largest patch rank the kernels are built and tested for.
MAX_RANK = 128

Factors = Optional[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class RopeSpec:
    """Which channels of which cache tensor carry RoPE, and how they pair.

    ``tensor``: ``"k"`` (MHA/GQA/M-RoPE) or ``"v"`` (MLA under transformers 5.18, where the cache's
    values hold k_pe). Channels ``[start, start + dim)`` rotate; ``dim`` is even and > 0.
    ``interleaved``: pairs ``(2i, 2i+1)`` (GPT-J/GLM/DeepSeek-V2) instead of ``(i, i + dim/2)``.
    """

    tensor: Literal["k", "v"]
    start: int
    dim: int
    interleaved: bool = False

    def __post_init__(self) -> None:
        if self.tensor not in ("k", "v"):
            raise KernelArgumentError(f"RopeSpec.tensor must be 'k' or 'v', not {self.tensor!r}")
        if int(self.start) < 0 or int(self.dim) <= 0 or int(self.dim) % 2:
            raise KernelArgumentError(
                f"RopeSpec needs start >= 0 and an even dim > 0 (got start={self.start}, dim={self.dim})"
            )

    @property
    def half(self) -> int:
        """Number of rotation pairs (= cos/sin columns)."""
        return self.dim // 2


@dataclass(frozen=True)
class ContiguousDest:
    """A contiguous cache ``k [B, H_k, T_total, d_k]``, ``v [B, H_v, T_total, d_v]`` (HF layout).

    The chunk's tokens are written at batch row ``batch``, token offsets ``[start, start + T)``;
    nothing else is touched. Only the channel dimension must be unit-stride.
    """

    k: torch.Tensor
    v: torch.Tensor
    batch: int = 0
    start: int = 0


@dataclass(frozen=True)
class PagedDest:
    """A paged cache ``k_cache [num_blocks, block_size, H_k, d_k]`` (and ``v_cache``), vLLM-style.

    Token ``t`` of the chunk goes to ``slot_mapping[t] = block * block_size + offset`` (int64,
    ``[T]``, see :func:`slot_mapping_from_block_table`). Negative slots are padding and are skipped
    (vLLM's convention). A slot past the cache is an error, raised on CPU tensors; on CUDA the
    kernel checks nothing on the host (no device sync) but never writes outside the cache.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor


Dest = Union[ContiguousDest, PagedDest]


def slot_mapping_from_block_table(
    block_table: torch.Tensor, start: int, n_tokens: int, block_size: int
) -> torch.Tensor:
    """``[n_tokens]`` int64 slots for sequence positions ``[start, start + n_tokens)``.

    ``block_table [n_blocks_of_seq]`` maps the sequence's logical block ``i`` to a physical cache
    block; position ``p`` lands at ``block_table[p // block_size] * block_size + p % block_size``.
    """
    if block_size <= 0:
        raise KernelArgumentError(f"block_size must be positive, not {block_size}")
    if start < 0:
        raise PositionError(f"negative start position {start}")
    pos = torch.arange(start, start + n_tokens, dtype=torch.int64, device=block_table.device)
    logical = pos // block_size
    if n_tokens and int(logical[-1]) >= block_table.numel():
        raise PositionError(
            f"positions up to {start + n_tokens - 1} need {int(logical[-1]) + 1} blocks; "
            f"the block table has {block_table.numel()}"
        )
    return block_table.to(torch.int64)[logical] * block_size + pos % block_size


class TensorJob:
    """One cache tensor's share of a fused apply, fully checked: what every backend consumes.

    ``content [H, T, d]``; ``u [T, m]`` / ``w [m, H*d]`` or ``None`` (m = 0); rotation of channels
    ``[rope_start, rope_start + 2*half)`` when ``half > 0`` with ``cos``/``sin [T, half]`` fp32.
    Destination: ``buf`` is either a contiguous cache ``[B, H, T_total, d]`` written at
    ``[batch, :, start:start+T]`` (``slots is None``), or a paged cache ``[NB, BS, H, d]`` written
    at ``slots [T]``.
    """

    __slots__ = ("content", "u", "w", "rope_start", "half", "interleaved", "cos", "sin", "buf", "batch", "start", "slots")

    def __init__(self, content, u, w, rope_start, half, interleaved, cos, sin, buf, batch, start, slots):
        self.content: torch.Tensor = content
        self.u: Optional[torch.Tensor] = u
        self.w: Optional[torch.Tensor] = w
        self.rope_start: int = rope_start
        self.half: int = half
        self.interleaved: bool = interleaved
        self.cos: Optional[torch.Tensor] = cos
        self.sin: Optional[torch.Tensor] = sin
        self.buf: torch.Tensor = buf
        self.batch: int = batch
        self.start: int = start
        self.slots: Optional[torch.Tensor] = slots

    @property
    def rank(self) -> int:
        return 0 if self.u is None else int(self.u.shape[1])

    def unit_channel_strides(self) -> bool:
        """Whether every tensor is read in place by a kernel that takes unit channel strides
        (content and factors along channels, contiguous tables, contiguous slots)."""
        if self.content.stride(2) != 1:
            return False
        if self.u is not None and (self.u.stride(1) != 1 or self.w.stride(1) != 1):  # type: ignore[union-attr]
            return False
        if self.cos is not None and not (self.cos.is_contiguous() and self.sin.is_contiguous()):  # type: ignore[union-attr]
            return False
        return self.slots is None or self.slots.stride(0) == 1

    def out_view(self) -> torch.Tensor:
        """The ``[H, T, d]`` destination view (contiguous destinations only)."""
        assert self.slots is None
        return self.buf[self.batch, :, self.start : self.start + self.content.shape[1]]


def _check_dtype(t: torch.Tensor, what: str) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise StorageDtypeError(f"{what} has dtype {t.dtype}; the kernels support fp32, bf16 and fp16")


def _check_factors(name: str, factors: Factors, H: int, T: int, d: int, device: torch.device) -> tuple:
    if factors is None:
        return None, None
    if not isinstance(factors, (tuple, list)) or len(factors) != 2:
        raise PatchError(f"{name}_factors must be a pair (u [T, m], w [m, H*d]), not {type(factors).__name__}")
    u, w = factors
    if not isinstance(u, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise PatchError(f"{name}_factors must hold two tensors")
    if u.dim() != 2 or w.dim() != 2 or u.shape[0] != T or w.shape[1] != H * d or u.shape[1] != w.shape[0]:
        raise PatchError(
            f"{name} patch factors u {tuple(u.shape)} / w {tuple(w.shape)} do not fit a [{H}, {T}, {d}] "
            f"tensor (need u [{T}, m], w [m, {H * d}])"
        )
    if u.shape[1] > MAX_RANK:
        raise PatchError(f"{name} patch rank {u.shape[1]} exceeds the supported maximum {MAX_RANK}")
    if u.dtype not in SUPPORTED_DTYPES or w.dtype not in SUPPORTED_DTYPES:
        raise StorageDtypeError(f"{name} patch factors have dtypes {u.dtype}/{w.dtype}; fp32, bf16 or fp16 only")
    if u.device != device or w.device != device:
        raise KernelArgumentError(f"{name} patch factors are not on the content's device {device}")
    if u.shape[1] == 0:
        return None, None
    return u, w


def _check_dest(buf: torch.Tensor, name: str, device: torch.device) -> None:
    if buf.dtype not in SUPPORTED_DTYPES:
        raise StorageDtypeError(f"destination {name} has dtype {buf.dtype}; fp32, bf16 or fp16 only")
    if buf.device != device:
        raise KernelArgumentError(f"destination {name} is on {buf.device}, the content on {device}")
    if buf.stride(-1) != 1:
        raise KernelArgumentError(f"destination {name} must have unit stride over channels")


def build_jobs(
    k_content: torch.Tensor,
    v_content: torch.Tensor,
    rope: Optional[RopeSpec],
    cos: Optional[torch.Tensor],
    sin: Optional[torch.Tensor],
    k_factors: Factors,
    v_factors: Factors,
    dest: Dest,
) -> tuple[TensorJob, TensorJob]:
    """Check one layer's arguments and split them into the K and V jobs (see :class:`TensorJob`).

    Raises :class:`KernelArgumentError` (inconsistent shapes/devices/strides),
    :class:`StorageDtypeError`, :class:`PatchError`, :class:`EmptyChunkError` or
    :class:`PositionError` (placement outside the destination).
    """
    if k_content.dim() != 3 or v_content.dim() != 3:
        raise KernelArgumentError(
            f"contents must be [H, T, d], got k {tuple(k_content.shape)} and v {tuple(v_content.shape)}"
        )
    H_k, T, d_k = k_content.shape
    H_v, T_v, d_v = v_content.shape
    if T_v != T:
        raise KernelArgumentError(f"k has {T} tokens but v has {T_v}")
    if T == 0:
        raise EmptyChunkError("a chunk must hold at least one token")
    for name, c in (("k", k_content), ("v", v_content)):
        if c.dtype not in SUPPORTED_DTYPES:
            raise StorageDtypeError(f"{name}_content has dtype {c.dtype}; the kernels support fp32, bf16 and fp16")
    device = k_content.device
    if v_content.device != device:
        raise KernelArgumentError("k_content and v_content are on different devices")

    if rope is not None:
        d_rot = d_k if rope.tensor == "k" else d_v
        if rope.start + rope.dim > d_rot:
            raise KernelArgumentError(
                f"rotary channels [{rope.start}, {rope.start + rope.dim}) exceed {rope.tensor}'s head dim {d_rot}"
            )
        for name, tab in (("cos", cos), ("sin", sin)):
            if tab is None or tab.dtype != torch.float32 or tab.shape != (T, rope.dim // 2):
                got = None if tab is None else (tuple(tab.shape), tab.dtype)
                raise KernelArgumentError(f"{name} must be fp32 [{T}, {rope.dim // 2}], got {got}")
            if tab.device != device:
                raise KernelArgumentError(f"{name} is not on the content's device {device}")

    if isinstance(dest, ContiguousDest):
        bufs, batch, start, slots = (dest.k, dest.v), int(dest.batch), int(dest.start), None
        for name, buf, H, d in (("k", dest.k, H_k, d_k), ("v", dest.v, H_v, d_v)):
            if buf.dim() != 4 or buf.shape[1] != H or buf.shape[3] != d:
                raise KernelArgumentError(f"destination {name} must be [B, {H}, T_total, {d}], got {tuple(buf.shape)}")
            if not 0 <= batch < buf.shape[0]:
                raise PositionError(f"batch row {batch} outside destination with {buf.shape[0]} rows")
            if start < 0 or start + T > buf.shape[2]:
                raise PositionError(
                    f"tokens [{start}, {start + T}) do not fit the destination's {buf.shape[2]} positions"
                )
            _check_dest(buf, name, device)
    elif isinstance(dest, PagedDest):
        bufs, batch, start, slots = (dest.k_cache, dest.v_cache), 0, 0, dest.slot_mapping
        if slots.dim() != 1 or slots.shape[0] != T or slots.dtype != torch.int64:
            raise KernelArgumentError(f"slot_mapping must be int64 [{T}], got {tuple(slots.shape)} {slots.dtype}")
        if slots.device != device:
            raise KernelArgumentError("slot_mapping is not on the content's device")
        top = int(slots.max()) if device.type == "cpu" else None  # no device sync on accelerators
        for name, buf, H, d in (("k", dest.k_cache, H_k, d_k), ("v", dest.v_cache, H_v, d_v)):
            if buf.dim() != 4 or buf.shape[2] != H or buf.shape[3] != d:
                raise KernelArgumentError(
                    f"paged {name} cache must be [num_blocks, block_size, {H}, {d}], got {tuple(buf.shape)}"
                )
            _check_dest(buf, name, device)
            if top is not None and top >= buf.shape[0] * buf.shape[1]:
                raise PositionError(f"slot {top} is past the {name} cache's {buf.shape[0] * buf.shape[1]} slots")
    else:
        raise KernelArgumentError(f"dest must be a ContiguousDest or PagedDest, not {type(dest).__name__}")

    k_u, k_w = _check_factors("k", k_factors, H_k, T, d_k, device)
    v_u, v_w = _check_factors("v", v_factors, H_v, T, d_v, device)
    on_k = rope is not None and rope.tensor == "k"
    on_v = rope is not None and rope.tensor == "v"
    r_start = rope.start if rope is not None else 0
    r_half = rope.dim // 2 if rope is not None else 0
    inter = bool(rope.interleaved) if rope is not None else False
    kj = TensorJob(
        k_content, k_u, k_w, r_start if on_k else 0, r_half if on_k else 0, inter and on_k,
        cos if on_k else None, sin if on_k else None, bufs[0], batch, start, slots,
    )
    vj = TensorJob(
        v_content, v_u, v_w, r_start if on_v else 0, r_half if on_v else 0, inter and on_v,
        cos if on_v else None, sin if on_v else None, bufs[1], batch, start, slots,
    )
    return kj, vj


def stacked_factors(f) -> bool:
    """Whether ``f`` is a stacked factor pair ``(u [L, T, m], w [L, m, H*d])`` for all layers."""
    return (
        isinstance(f, tuple)
        and len(f) == 2
        and isinstance(f[0], torch.Tensor)
        and isinstance(f[1], torch.Tensor)
        and f[0].dim() == 3
    )


def layer_arg(arg, i: int, stacked_dim: int):
    """Layer ``i`` of a per-layer argument: None, shared tensor, stacked tensor, stacked pair, or sequence."""
    if arg is None:
        return None
    if isinstance(arg, torch.Tensor):
        return arg[i] if arg.dim() == stacked_dim + 1 else arg
    if stacked_factors(arg):
        return (arg[0][i], arg[1][i])
    return arg[i]


# ----------------------------------------------------------------------------- layers laid out alike
# A whole chunk goes to a backend in one call when every layer is laid out like layer 0: layer 0
# is checked in full (build_jobs), the others only for that likeness, and each per-layer argument
# is reduced to its layers' data addresses.


class LayerMismatch(Exception):
    """A layer is laid out differently from layer 0: the caller uses the per-layer path."""


def tensor_signature(t: torch.Tensor) -> tuple:
    """What two layers' tensors must share to run with layer 0's parameters."""
    return (t.shape, t.stride(), t.dtype, t.device)


def dest_tensors(d: Dest) -> tuple[torch.Tensor, torch.Tensor]:
    """The (K, V) cache tensors of a destination."""
    return (d.k, d.v) if isinstance(d, ContiguousDest) else (d.k_cache, d.v_cache)


def dest_addresses(dests: "list[Dest] | tuple[Dest, ...]") -> "tuple[list[int], list[int]] | None":
    """Data addresses of each layer's (K, V) destination tensors when every destination is laid
    out like ``dests[0]`` on its device; ``None`` when one is not.

    Runs per call for every layer, so the per-layer work is list comprehensions compared in one
    go (shape, dtype and device index; strides only where a tensor is not contiguous, since
    contiguous tensors of equal shape have equal strides)."""
    d0 = dests[0]
    if isinstance(d0, ContiguousDest):
        key = (ContiguousDest, d0.batch, d0.start)
        if [(type(d), d.batch, d.start) for d in dests] != [key] * len(dests):  # type: ignore[union-attr]
            return None
        pairs = [(d.k, d.v) for d in dests]  # type: ignore[union-attr]
    else:
        if any(type(d) is not PagedDest or d.slot_mapping is not d0.slot_mapping for d in dests):  # type: ignore[union-attr]
            return None
        pairs = [(d.k_cache, d.v_cache) for d in dests]  # type: ignore[union-attr]
    addresses = []
    for i in (0, 1):
        ts = [p[i] for p in pairs]
        t0 = ts[0]
        sig0 = (t0.shape, t0.dtype, t0.get_device())
        if [(t.shape, t.dtype, t.get_device()) for t in ts] != [sig0] * len(ts):
            return None
        if not all(t.is_contiguous() for t in ts) and [t.stride() for t in ts] != [t0.stride()] * len(ts):
            return None
        addresses.append([t.data_ptr() for t in ts])
    return addresses[0], addresses[1]


def layer0_jobs(k, v, rope, cos, sin, kf, vf, dests, out_k, out_v) -> tuple[TensorJob, TensorJob]:
    """Layer 0's checked (K, V) jobs of a whole-chunk call: into ``dests[0]``, or into
    ``out_k[0]`` / ``out_v[0]`` when ``dests`` is ``None`` (arguments as :func:`fused_apply_layers`'s)."""
    dest0 = ContiguousDest(out_k[0], out_v[0]) if dests is None else dests[0]
    return build_jobs(
        layer_arg(k, 0, 3), layer_arg(v, 0, 3), rope, layer_arg(cos, 0, 2), layer_arg(sin, 0, 2),
        layer_arg(kf, 0, 2), layer_arg(vf, 0, 2), dest0,
    )


def layer_addresses(arg, L: int, stacked_dim: int, ref: torch.Tensor) -> list[int]:
    """Data address of each layer's tensor of a per-layer argument laid out like ``ref`` (layer 0's).

    Raises :class:`LayerMismatch` when a layer's tensor is laid out differently."""
    if isinstance(arg, torch.Tensor):
        if arg.dim() == stacked_dim + 1:  # stacked
            base, step = arg.data_ptr(), arg.stride(0) * arg.element_size()
            return [base + i * step for i in range(L)]
        return [arg.data_ptr()] * L  # shared by every layer
    sig = tensor_signature(ref)
    out = []
    for t in arg:
        if not isinstance(t, torch.Tensor) or tensor_signature(t) != sig:
            raise LayerMismatch
        out.append(t.data_ptr())
    return out


def factor_addresses(f, L: int, job: TensorJob) -> tuple[list[int], list[int]]:
    """Per-layer data addresses of ``(u, w)`` (zeros when layer 0 is unpatched, and so every layer)."""
    if job.u is None or job.w is None:  # layer 0 unpatched: so must every layer be
        if f is not None and not stacked_factors(f) and any(x is not None for x in f):
            raise LayerMismatch
        return [0] * L, [0] * L
    if stacked_factors(f):
        return layer_addresses(f[0], L, 2, job.u), layer_addresses(f[1], L, 2, job.w)
    pairs = list(f)
    if any(x is None for x in pairs):
        raise LayerMismatch
    return layer_addresses([x[0] for x in pairs], L, 2, job.u), layer_addresses([x[1] for x in pairs], L, 2, job.w)
