"""KV as the model caches it: per layer ``(k [H_k, T, d_k], v [H_v, T, d_v])``, and the few
operations every layer uses on it (concatenation along the tokens, byte counts)."""

from __future__ import annotations

from typing import Sequence

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]


def tensor_nbytes(t: torch.Tensor) -> int:
    """Payload bytes of one tensor (`numel * element_size`)."""
    return t.numel() * t.element_size()


def kv_nbytes(layers: Sequence[LayerKV], tokens: int | None = None) -> int:
    """Payload bytes of per-layer KV ``(k [H, T, d], v [H, T, d])``, keys and values of every layer;
    with ``tokens``, the bytes that many token rows of each layer take (a prefix or a selection)."""
    if tokens is None:
        return sum(tensor_nbytes(k) + tensor_nbytes(v) for k, v in layers)
    return sum(tokens * (tensor_nbytes(t) // max(1, t.shape[1])) for k, v in layers for t in (k, v))


def concat_kv(parts: Sequence[Sequence[LayerKV]], dtype: torch.dtype | None = None) -> list[LayerKV]:
    """Concatenate per-layer KV along the token axis: parts of ``(k [H,T_i,d], v [H,T_i,d])``,
    optionally cast to ``dtype``. Always new tensors."""
    def cat(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.to(dtype) for t in ts] if dtype is not None else ts, dim=1)

    return [(cat([p[l][0] for p in parts]), cat([p[l][1] for p in parts])) for l in range(len(parts[0]))]
