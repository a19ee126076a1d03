"""The operator: relocate a chunk exactly, optionally add its conditioning patch. Zero forwards.

``relocate(chunk, start)`` returns per layer ``(k, v)`` exactly as the model would cache the
chunk's tokens at ``start + rel_positions``: fp32 rotation from the content frame with the
model's raw ``inv_freq`` (never chained rotations, never the model's cos/sin). The heavy lifting
is one fused call over all layers into ``contextdeque.kernels`` (a compiled kernel or torch on
CPU, Triton on CUDA).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from .chunk import Chunk, check_finite
from .args import check_instance, check_int
from .errors import ArgumentError, ArgumentTypeError, FingerprintMismatchError, PositionError
from .kv import LayerKV, RelocatedKV
from ..kernels import MAX_RANK, RopeSpec, fused_apply, fused_apply_layers
from .layout import KVLayout, layout_for
from .rotation import TableCache, check_positions

Factors = tuple[torch.Tensor, torch.Tensor]


class Conditioning(Protocol):
    """What the operator needs of a conditioning patch (``contextdeque.patch.Patch`` is one): a
    check that it was formed for this chunk, and its low-rank factors per layer."""

    def check_fits(self, chunk: Chunk) -> None: ...

    def factors(self, layer: int) -> tuple[Factors | None, Factors | None]:
        """``((u_K [T, m], w_K [m, F_K]), (u_V, w_V))`` of one layer, None where absent."""
        ...


def rope_spec(layout: KVLayout) -> RopeSpec:
    """The kernels' description of which channels rotate, from a layout."""
    return RopeSpec(layout.rope_tensor, layout.rope_start, layout.rope_dim, layout.interleaved)


def _stack_factors(factors: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Several patches' factors as one product: concatenate along the rank (``u [T, Σm]``, ``w [Σm, F]``)."""
    factors = [f for f in factors if f[0].shape[-1]]
    if not factors:
        return None
    if len(factors) == 1:
        return factors[0]
    dt = factors[0][0].dtype
    if any(u.dtype != dt or w.dtype != dt for u, w in factors):  # e.g. an fp32-kept patch among fp16 ones
        factors = [(u.to(torch.float32), w.to(torch.float32)) for u, w in factors]
    return torch.cat([u for u, _ in factors], dim=1), torch.cat([w for _, w in factors], dim=0)


def placement_positions(
    chunk: Chunk,
    start: int | None = None,
    positions: torch.Tensor | None = None,
    section_shift: Sequence[int] | None = None,
) -> torch.Tensor:
    """``[n_axes, T]`` absolute positions for a placement.

    Either ``start`` (the chunk's relative grid shifted to start there), an explicit per-token
    ``positions`` (``[T]`` or ``[n_axes, T]``), and optionally a per-axis ``section_shift``
    (M-RoPE re-timing, e.g. ``(dt, 0, 0)``) added on top.
    """
    if positions is None:
        if start is None:
            raise PositionError("give a start position or explicit positions")
        if int(start) < 0:
            raise PositionError(f"negative start position {start}")
        pos = chunk.positions(int(start))
    else:
        pos = torch.as_tensor(positions, dtype=torch.long)
        if pos.dim() == 1:
            pos = pos.unsqueeze(0).expand(chunk.rel_positions.shape[0], -1)
        if pos.shape[-1] != chunk.n_tokens:
            raise PositionError(f"{pos.shape[-1]} positions for a chunk of {chunk.n_tokens} tokens")
    if section_shift is not None:
        shift = torch.as_tensor(list(section_shift), dtype=torch.long)
        if shift.numel() != pos.shape[0]:
            raise PositionError(f"section_shift needs {pos.shape[0]} entries (one per position axis)")
        pos = pos + shift.unsqueeze(1)
    return pos


def check_compatible(chunk: Chunk, layout: KVLayout, fingerprint: str | None = None) -> None:
    if chunk.layout_signature != layout.signature:
        raise FingerprintMismatchError(
            f"chunk {chunk.id[:12]} was encoded under layout {chunk.layout_signature}, not {layout.signature}"
        )
    if fingerprint is not None and chunk.fingerprint != fingerprint:
        raise FingerprintMismatchError(
            f"chunk {chunk.id[:12]} was encoded by model {chunk.fingerprint[:12]}, not {fingerprint[:12]}"
        )


def relocate(
    chunk: Chunk,
    start: int | None = None,
    *,
    layout: KVLayout | None = None,
    positions: torch.Tensor | None = None,
    section_shift: Sequence[int] | None = None,
    patch: "Conditioning | Sequence[Conditioning] | None" = None,
    out_dtype: torch.dtype | None = None,
    fingerprint: str | None = None,
    beyond_trained: bool = False,
    layers: Sequence[int] | None = None,
) -> RelocatedKV:
    """The chunk's KV as the model would cache it at the given positions (+ an optional patch).

    Returns per layer ``(k [H_k, T, d_k], v [H_v, T, d_v])`` in ``out_dtype`` (default: the model's
    compute dtype), as a :class:`~contextdeque.core.kv.RelocatedKV` (a list that prints as one line). ``layout`` defaults to the one a loaded backend registered for the chunk's
    layout signature (:func:`.layout.layout_for`). ``layers``: only these layers, in this order
    (entry ``i`` of the result is layer ``layers[i]``; the same values as the full result's): a
    consumer that reads one layer at a time (a serving engine's layer-wise load) computes no more.

    Raises:
        PositionError: a position is negative, past the exact RoPE regime, or (unless
            ``beyond_trained``) past the model's trained context length.
        NumericsError: the patched KV overflows a float16 output (inputs are checked finite
            where they enter: :class:`Chunk`, ``Patch``).
    """
    check_instance("chunk", chunk, Chunk, "a Chunk")
    check_int("start", start, none_ok=True, error=PositionError)
    check_instance("layout", layout, KVLayout, "a KVLayout", none_ok=True)
    check_instance("positions", positions, torch.Tensor, "an integer [n_axes, T] tensor", none_ok=True)
    check_instance("out_dtype", out_dtype, torch.dtype, "a torch dtype", none_ok=True)
    layout = layout or layout_for(chunk.layout_signature)
    check_compatible(chunk, layout, fingerprint)
    pos = placement_positions(chunk, start, positions, section_shift)
    check_positions(pos, layout, beyond_trained=beyond_trained)
    patches = _as_patch_list(patch)
    for p in patches:
        p.check_fits(chunk)
    dtype = out_dtype or layout.torch_compute_dtype
    tables = TableCache(layout, pos, device=chunk.keys.device)
    spec = rope_spec(layout)
    L = chunk.num_layers
    if layers is None:
        chosen = list(range(L))
    else:
        chosen = [int(layer) for layer in layers]
        if any(not 0 <= layer < L for layer in chosen):
            raise ArgumentError(f"layers: indices must lie in [0, {L}), got {chosen}")
    tables = [tables.for_layer(layer) for layer in chosen]
    cos = [c for c, _ in tables]
    sin = [t for _, t in tables]
    where = None if positions is not None else (int(start) if start is not None else None)
    if not patches:  # pure relocation: the stacked content in one kernel call
        keys, values = (chunk.keys, chunk.values) if layers is None else (chunk.keys[chosen], chunk.values[chosen])
        return RelocatedKV(fused_apply_layers(keys, values, spec, cos, sin, out_dtype=dtype), start=where)
    ks, vs, kfs, vfs = [], [], [], []
    for layer in chosen:
        k, v = chunk.layer(layer)
        fk, fv = [], []
        for p in patches:
            pk, pv = p.factors(layer)
            fk += [pk] if pk is not None else []
            fv += [pv] if pv is not None else []
        k_f, v_f = _stack_factors(fk), _stack_factors(fv)
        # the fused kernel takes ranks up to MAX_RANK; a larger (e.g. full-rank) sum is folded
        # into the content first, in fp32
        if k_f is not None and k_f[0].shape[1] > MAX_RANK:
            k, k_f = _fold(k, k_f), None
        if v_f is not None and v_f[0].shape[1] > MAX_RANK:
            v, v_f = _fold(v, v_f), None
        ks.append(k), vs.append(v), kfs.append(k_f), vfs.append(v_f)
    out = RelocatedKV(fused_apply_layers(ks, vs, spec, cos, sin, kfs, vfs, out_dtype=dtype), start=where,
                      n_patches=len(patches))
    if dtype == torch.float16:
        # pages and factors were checked finite where they entered (Chunk/Patch construction); a
        # float32/bfloat16 sum of finite values cannot overflow, a float16 one can (past 65504)
        check_finite([t for kv in out for t in kv], f"the patched KV of chunk {chunk.id[:12]}")
    return out


def _fold(content: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``content [H,T,d] + u @ w`` in fp32."""
    H, T, d = content.shape
    u, w = factors
    delta = (u.to(torch.float32) @ w.to(torch.float32)).view(T, H, d).transpose(0, 1)
    return content.to(torch.float32) + delta


def _as_patch_list(patch: "Conditioning | Sequence[Conditioning] | None") -> list[Conditioning]:
    if patch is None:
        return []
    out = list(patch) if isinstance(patch, (list, tuple)) else [patch]
    for i, p in enumerate(out):
        if not (callable(getattr(p, "factors", None)) and callable(getattr(p, "check_fits", None))):
            raise ArgumentTypeError(f"patch must be a Patch (or a list of them), got {type(p).__name__} at index {i}")
    return out


def apply(chunk: Chunk, start: int, patch: "Conditioning | Sequence[Conditioning] | None" = None, **kw) -> RelocatedKV:
    """Relocate + conditioning patch: ``K = R(pos)(K_content + U_K V_K^T)``, ``V = V_content + U_V V_V^T``."""
    return relocate(chunk, start, patch=patch, **kw)


def to_content_frame(
    kv: list[LayerKV], layout: KVLayout, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Un-rotate cached ``kv`` (per layer ``[H, T, d]`` at ``positions [n_axes, T]``) into the content
    frame. Returns stacked fp32 ``keys [L,H_k,T,d_k]``, ``values [L,H_v,T,d_v]``."""
    tables = TableCache(layout, positions, device=kv[0][0].device)
    spec = rope_spec(layout)
    keys, values = [], []
    for layer, (k, v) in enumerate(kv):
        cos, sin = tables.for_layer(layer)
        k, v = fused_apply(k, v, spec, cos, -sin, out_dtype=torch.float32)  # R(-pos)
        keys.append(k)
        values.append(v)
    return torch.stack(keys), torch.stack(values)
