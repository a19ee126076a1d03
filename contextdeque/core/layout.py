"""KVLayout: what a model caches per layer and how its keys carry position, read from the model.

A layout answers, for every decoder layer: which cache tensor carries the rotary channels
("k" for MHA/GQA, "v" for MLA under transformers 5.18 where ``.values`` holds k_pe), which channel
range rotates (partial rotary), how channels pair (half-split vs interleaved), which ``inv_freq``
table the layer uses (per-layer bases, e.g. Gemma3 local/global), which position axis each
frequency reads (M-RoPE), and up to which position relocation stays exact (dynamic NTK / LongRoPE
switch points). Layers without positional rotation (NoPE layers, ALiBi models) carry an all-zero
``inv_freq`` table: their relocation is the identity, exactly (cos 0 = 1, sin 0 = 0).

The layout is read off the loaded model and proven against its own forward by
``contextdeque.model.detect`` (:func:`contextdeque.detect_layout`); layouts that cannot be relocated
exactly are refused there with :class:`UnsupportedLayoutError` and the reason.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

import torch

from .errors import UnsupportedLayoutError

# Kinds whose inv_freq switches with sequence length: exact only below the switch point. This decides
# a position limit, not acceptance: acceptance is the structural probe plus the proof at load
# (``contextdeque.model.detect``).
REGIME_ROPE_TYPES = {"dynamic", "longrope"}


@dataclass(frozen=True)
class KVLayout:
    """How one model caches K/V and applies RoPE. Immutable; ``signature`` identifies it.

    Per layer the cache holds ``k: [k_heads, T, k_dim]`` and ``v: [v_heads, T, v_dim]``; channels
    ``[rope_start, rope_start + rope_dim)`` of tensor ``rope_tensor`` are rotated by position.
    """

    model_type: str  # for display only: nothing is decided by it
    family: str  # "gqa" (rotated channels in K) or "mla" (rotated k_pe in V, latent in K)
    num_layers: int
    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int
    rope_tensor: str  # "k" or "v"
    rope_start: int
    rope_dim: int
    interleaved: bool
    inv_freqs: tuple[tuple[float, ...], ...]  # distinct fp32 tables (exact as python floats)
    layer_table: tuple[int, ...]  # per layer: index into inv_freqs
    rope_type: str
    attention_scaling: float
    n_pos_axes: int = 1  # 3 for M-RoPE (t, h, w)
    freq_axis: tuple[int, ...] | None = None  # M-RoPE: position axis of each frequency
    max_exact_position: int | None = None  # positions >= this leave the exact RoPE regime
    sliding_windows: tuple[int | None, ...] = ()
    compute_dtype: str = "float32"
    notes: tuple[str, ...] = field(default=())
    # the model's trained context (config.max_position_embeddings); positions past it raise
    # PositionError unless the caller opts in. Not part of the signature: it limits where KV may
    # be placed, not what stored KV means.
    max_trained_position: int | None = field(default=None, metadata={"signature": False})

    @property
    def identity_layers(self) -> tuple[bool, ...]:
        """Per layer: True where relocation is the identity (no positional rotation: NoPE, ALiBi)."""
        zero = [all(f == 0.0 for f in t) for t in self.inv_freqs]
        return tuple(zero[i] for i in self.layer_table)

    @property
    def kv_channels(self) -> int:
        """K and V values cached per token, over all layers (x element size = KV bytes per token)."""
        return self.num_layers * (self.k_heads * self.k_dim + self.v_heads * self.v_dim)

    @property
    def n_freq(self) -> int:
        return self.rope_dim // 2

    def inv_freq(self, layer: int) -> torch.Tensor:
        """fp32 ``[rope_dim/2]`` inverse frequencies used by ``layer``."""
        return torch.tensor(self.inv_freqs[self.layer_table[layer]], dtype=torch.float32)

    def freq_axis_tensor(self) -> torch.Tensor:
        """``[rope_dim/2]`` int64: which position axis each frequency reads (zeros for 1-D RoPE)."""
        if self.freq_axis is None:
            return torch.zeros(self.n_freq, dtype=torch.long)
        return torch.tensor(self.freq_axis, dtype=torch.long)

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        return getattr(torch, self.compute_dtype)

    @cached_property
    def signature(self) -> str:
        """Stable hash of everything that decides the KV bytes' meaning."""
        blob = json.dumps(
            {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("signature", True)},
            sort_keys=True, default=str,
        ).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def describe(self) -> str:
        conv = "interleaved" if self.interleaved else "half-split"
        parts = [
            f"{self.model_type} ({self.family.upper()}), {self.num_layers} layers",
            f"k [{self.k_heads}x{self.k_dim}] v [{self.v_heads}x{self.v_dim}]",
        ]
        ident = self.identity_layers
        if all(ident):
            parts.append("no positional rotation in the cache: relocation is the identity")
        else:
            parts += [
                f"rope on {self.rope_tensor}[{self.rope_start}:{self.rope_start + self.rope_dim}] {conv}",
                f"{len(self.inv_freqs)} inv_freq table(s), scaling={self.rope_type}",
            ]
            if any(ident):
                parts.append(f"{sum(ident)} NoPE layer(s) relocate as the identity")
        if self.n_pos_axes > 1:
            parts.append(f"M-RoPE {self.n_pos_axes} axes")
        if self.max_exact_position is not None:
            parts.append(f"exact below position {self.max_exact_position}")
        return "; ".join(parts)


def probe_freq_axis(rotary: torch.nn.Module, n_freq: int, interleave_cat: bool = True) -> tuple[int, ...]:
    """Ask the model's own M-RoPE module which axis each frequency reads: feed a position on one
    axis at a time and see which sines come out non-zero. Independent of chunked vs interleaved
    sectioning and of the transformers version."""
    axes = [-1] * n_freq
    x = torch.zeros(1, 1, 1, dtype=torch.float32)
    for axis in range(3):
        pos = torch.zeros(3, 1, 1, dtype=torch.long)
        pos[axis] = 997
        with torch.no_grad():
            _, sin = rotary(x, pos)
        sin = sin.reshape(-1)[:n_freq]
        for f in range(n_freq):
            if sin[f].item() != 0.0:
                axes[f] = axis
    if any(a < 0 for a in axes):
        raise UnsupportedLayoutError("could not map every M-RoPE frequency to a position axis")
    return tuple(axes)


def trained_length(cfg: Any) -> int | None:
    """The context length a model was trained for (``max_position_embeddings``, or GPT-style
    ``n_positions``), or None when its config does not say."""
    n = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


# ---------------------------------------------------------------------------- loaded layouts

#: The layouts of the models loaded in this process, by signature: every ``HFBackend`` registers
#: its model's layout when it is built (``load_model`` builds one), so ``relocate(chunk, start)``
#: finds a chunk's layout from the chunk's own ``layout_signature`` without being handed it.
LOADED_LAYOUTS: dict[str, KVLayout] = {}


def register_layout(layout: KVLayout) -> None:
    """Make ``layout`` known to :func:`layout_for` (a backend does this for its model)."""
    LOADED_LAYOUTS[layout.signature] = layout


def layout_for(signature: str) -> KVLayout:
    """The loaded layout with ``signature``; refused when no model of that layout is loaded."""
    from .errors import FingerprintMismatchError

    try:
        return LOADED_LAYOUTS[signature]
    except KeyError:
        raise FingerprintMismatchError(
            f"no loaded model has layout {signature}; load the model that encoded this chunk or pass layout="
        ) from None
