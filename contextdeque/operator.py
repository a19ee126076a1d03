"""The operator: relocate a chunk exactly, optionally add its conditioning patch. Zero forwards.

``relocate(chunk, start)`` returns per layer ``(k, v)`` exactly as the model would cache the
chunk's tokens at ``start + rel_positions``: fp32 rotation from the content frame with the
model's raw ``inv_freq`` (never chained rotations, never the model's cos/sin). The heavy lifting
is one fused call per layer into ``contextdeque.kernels`` (torch on CPU, Triton on CUDA).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from .chunk import Chunk
from .errors import FingerprintMismatchError, PositionError
from .layout import KVLayout
from .rotation import TableCache, check_positions

if TYPE_CHECKING:  # pragma: no cover
    from .patch.base import Patch

LayerKV = tuple[torch.Tensor, torch.Tensor]


def rotate_slice(x: torch.Tensor, layout: KVLayout, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the rotary channels of ``x [H, T, d]`` by per-token angles (cos/sin ``[T, F]``), fp32.

    Returns a new fp32 tensor; non-rotary channels are copied. Passing ``-sin`` un-rotates.
    """
    out = x.to(torch.float32).clone()
    a, n = layout.rope_start, layout.rope_dim
    seg = out[..., a : a + n]
    if layout.interleaved:
        x1, x2 = seg[..., 0::2].clone(), seg[..., 1::2].clone()
        seg[..., 0::2] = x1 * cos - x2 * sin
        seg[..., 1::2] = x2 * cos + x1 * sin
    else:
        h = n // 2
        x1, x2 = seg[..., :h].clone(), seg[..., h:].clone()
        seg[..., :h] = x1 * cos - x2 * sin
        seg[..., h:] = x2 * cos + x1 * sin
    return out


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
    patch: "Patch | Sequence[Patch] | None" = None,
    out_dtype: torch.dtype | None = None,
    fingerprint: str | None = None,
) -> list[LayerKV]:
    """The chunk's KV as the model would cache it at the given positions (+ an optional patch).

    Returns per layer ``(k [H_k, T, d_k], v [H_v, T, d_v])`` in ``out_dtype`` (default: the model's
    compute dtype). ``layout`` defaults to the one registered for the chunk's model.
    """
    layout = layout or _layout_for(chunk)
    check_compatible(chunk, layout, fingerprint)
    pos = placement_positions(chunk, start, positions, section_shift)
    check_positions(pos, layout)
    patches = _as_patch_list(patch)
    for p in patches:
        p.check_fits(chunk)
    dtype = out_dtype or layout.torch_compute_dtype
    tables = TableCache(layout, pos, device=chunk.keys.device)
    out: list[LayerKV] = []
    for layer in range(chunk.num_layers):
        k, v = chunk.layer(layer)
        k32, v32 = k.to(torch.float32), v.to(torch.float32)
        for p in patches:
            dk, dv = p.layer_delta(layer)
            if dk is not None:
                k32 = k32 + dk
            if dv is not None:
                v32 = v32 + dv
        cos, sin = tables.for_layer(layer)
        if layout.rope_tensor == "k":
            k32 = rotate_slice(k32, layout, cos, sin)
        else:
            v32 = rotate_slice(v32, layout, cos, sin)
        out.append((k32.to(dtype), v32.to(dtype)))
    return out


def _as_patch_list(patch: "Patch | Sequence[Patch] | None") -> list["Patch"]:
    if patch is None:
        return []
    if isinstance(patch, (list, tuple)):
        return list(patch)
    return [patch]


def apply(chunk: Chunk, start: int, patch: "Patch | Sequence[Patch] | None" = None, **kw) -> list[LayerKV]:
    """Relocate + conditioning patch: ``K = R(pos)(K_content + U_K V_K^T)``, ``V = V_content + U_V V_V^T``."""
    return relocate(chunk, start, patch=patch, **kw)


def to_content_frame(
    kv: list[LayerKV], layout: KVLayout, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Un-rotate cached ``kv`` (per layer ``[H, T, d]`` at ``positions [n_axes, T]``) into the content
    frame. Returns stacked fp32 ``keys [L,H_k,T,d_k]``, ``values [L,H_v,T,d_v]``."""
    tables = TableCache(layout, positions, device=kv[0][0].device)
    keys, values = [], []
    for layer, (k, v) in enumerate(kv):
        cos, sin = tables.for_layer(layer)
        if layout.rope_tensor == "k":
            k = rotate_slice(k, layout, cos, -sin)
        else:
            v = rotate_slice(v, layout, cos, -sin)
        keys.append(k.to(torch.float32))
        values.append(v.to(torch.float32))
    return torch.stack(keys), torch.stack(values)


# Layouts by signature, registered by backends when they encode, so relocate(chunk, start) works
# without passing the layout around.
_LAYOUTS: dict[str, KVLayout] = {}


def register_layout(layout: KVLayout) -> None:
    _LAYOUTS[layout.signature] = layout


def _layout_for(chunk: Chunk) -> KVLayout:
    try:
        return _LAYOUTS[chunk.layout_signature]
    except KeyError:
        raise FingerprintMismatchError(
            f"no loaded model has layout {chunk.layout_signature}; load the model that encoded this chunk "
            "or pass layout="
        ) from None
