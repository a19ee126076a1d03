"""RoPE angle tables built exactly the way transformers builds them.

The model computes ``angle = fp32(inv_freq[f]) * fp32(position)`` (one rounding), then fp32
cos/sin, then multiplies by ``attention_scaling``. We build the same angles and cos/sin but never
the scaling: a shift rotation must be a pure rotation, otherwise YaRN/LongRoPE scaling would be
applied twice (the cached keys already carry it, and so does the content frame).
"""

from __future__ import annotations

import torch

from .errors import PositionError
from .layout import KVLayout

# positions are fed to the model as fp32; beyond 2**24 consecutive integers are not representable
MAX_POSITION = 2**24


def check_positions(positions: torch.Tensor, layout: KVLayout, *, beyond_trained: bool = False) -> None:
    """Refuse negative positions, positions fp32 cannot represent, positions past the RoPE regime
    switch (dynamic NTK / LongRoPE) where relocation could not be exact, and (unless
    ``beyond_trained``) positions past the model's trained context length."""
    if positions.numel() == 0:
        return
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0:
        raise PositionError(f"negative position {lo}")
    if hi >= MAX_POSITION:
        raise PositionError(f"position {hi} overflows the exact fp32 position range (< {MAX_POSITION})")
    if layout.max_exact_position is not None and hi >= layout.max_exact_position:
        raise PositionError(
            f"position {hi} is past the {layout.rope_type} switch point ({layout.max_exact_position}): the model "
            "would use a different inv_freq there, so relocation cannot be exact"
        )
    limit = layout.max_trained_position
    if not beyond_trained and limit is not None and hi >= limit:
        raise PositionError(
            f"position {hi} is past the model's trained context ({limit} positions): the model never saw "
            "it; pass beyond_trained=True (ContextWindow(..., beyond_trained=True)) to place KV there anyway"
        )


def rope_tables(
    inv_freq: torch.Tensor, positions: torch.Tensor, freq_axis: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, F]`` fp32 for ``positions`` (``[T]`` or ``[n_axes, T]`` int) and ``inv_freq [F]``.

    For M-RoPE, frequency f reads axis ``freq_axis[f]`` of the positions.
    """
    inv = inv_freq.to(torch.float32)
    pos = positions.to(torch.float32)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if freq_axis is None or pos.shape[0] == 1:
        per_freq = pos[0].unsqueeze(1).expand(-1, inv.shape[0])  # [T, F]
    else:
        per_freq = pos.index_select(0, freq_axis.to(pos.device)).transpose(0, 1)  # [T, F]
    angle = per_freq * inv.to(pos.device).unsqueeze(0)
    return torch.cos(angle), torch.sin(angle)


class TableCache:
    """Builds cos/sin once per distinct inv_freq table for one placement (shared by all layers)."""

    def __init__(self, layout: KVLayout, positions: torch.Tensor, device: torch.device | str = "cpu"):
        self.layout = layout
        self.positions = positions
        self.device = device
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._axis = layout.freq_axis_tensor() if layout.n_pos_axes > 1 else None

    def for_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.layout.layer_table[layer]
        if idx not in self._tables:
            cos, sin = rope_tables(self.layout.inv_freq(layer), self.positions, self._axis)
            self._tables[idx] = (cos.to(self.device), sin.to(self.device))
        return self._tables[idx]
