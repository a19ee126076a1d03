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


class RelocatedKV(list):
    """What ``relocate`` / ``apply`` return: a list of per-layer ``(k [H_k, T, d_k], v [H_v, T, d_v])``
    (every list operation works on it as before) that prints as one line instead of its tensors.

    ``start``: the first position it was placed at (None for per-token ``positions``);
    ``n_patches``: the conditioning patches applied."""

    def __init__(self, layers: Sequence[LayerKV] = (), *, start: int | None = None, n_patches: int = 0) -> None:
        super().__init__(layers)
        self.start = start
        self.n_patches = n_patches

    @property
    def nbytes(self) -> int:
        """Payload bytes of every layer's keys and values."""
        return kv_nbytes(self)

    def __repr__(self) -> str:
        from .chunk import format_bytes

        if not self:
            return "RelocatedKV(0 layers)"
        k, v = self[0]
        where = f", start {self.start}" if self.start is not None else ""
        patched = f", {self.n_patches} patch{'es' if self.n_patches != 1 else ''}" if self.n_patches else ""
        return (f"RelocatedKV({len(self)} layers, k {list(k.shape)}, v {list(v.shape)}, "
                f"{str(k.dtype).replace('torch.', '')}{where}{patched}, {format_bytes(self.nbytes)})")

    __str__ = __repr__


def concat_kv(parts: Sequence[Sequence[LayerKV]], dtype: torch.dtype | None = None) -> list[LayerKV]:
    """Concatenate per-layer KV along the token axis: parts of ``(k [H,T_i,d], v [H,T_i,d])``,
    optionally cast to ``dtype``. Always new tensors."""
    def cat(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.to(dtype) for t in ts] if dtype is not None else ts, dim=1)

    return [(cat([p[l][0] for p in parts]), cat([p[l][1] for p in parts])) for l in range(len(parts[0]))]
