"""KVLayout: what a model caches per layer and how its keys carry position, read from the model.

A layout answers, for every decoder layer: which cache tensor carries the rotary channels
("k" for MHA/GQA, "v" for MLA under transformers 5.18 where ``.values`` holds k_pe), which channel
range rotates (partial rotary), how channels pair (half-split vs interleaved), which ``inv_freq``
table the layer uses (per-layer bases, e.g. Gemma3 local/global), which position axis each
frequency reads (M-RoPE), and up to which position relocation stays exact (dynamic NTK / LongRoPE
switch points). Layouts we cannot relocate exactly are refused with :class:`UnsupportedLayoutError`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

import torch

from . import compat
from .errors import UnsupportedLayoutError

# model_type -> (family, interleaved pairs). Anything not listed is refused: we only claim
# layouts whose relocation is proven by a test against transformers' own forward.
_HALF, _INTERLEAVED = False, True
SUPPORTED_MODEL_TYPES: dict[str, tuple[str, bool]] = {
    "llama": ("gqa", _HALF),
    "mistral": ("gqa", _HALF),
    "qwen2": ("gqa", _HALF),
    "qwen3": ("gqa", _HALF),
    "qwen2_vl": ("gqa", _HALF),
    "qwen2_vl_text": ("gqa", _HALF),
    "qwen2_5_vl": ("gqa", _HALF),
    "qwen2_5_vl_text": ("gqa", _HALF),
    "qwen3_vl": ("gqa", _HALF),
    "qwen3_vl_text": ("gqa", _HALF),
    "gemma3_text": ("gqa", _HALF),
    "gemma2": ("gqa", _HALF),
    "phi3": ("gqa", _HALF),
    "phi": ("gqa", _HALF),
    "stablelm": ("gqa", _HALF),
    "gpt_neox": ("gqa", _HALF),
    "persimmon": ("gqa", _HALF),
    "cohere": ("gqa", _INTERLEAVED),
    "gptj": ("gqa", _INTERLEAVED),
    "glm": ("gqa", _INTERLEAVED),
    "glm4": ("gqa", _INTERLEAVED),
    "deepseek_v2": ("mla", _INTERLEAVED),
    "deepseek_v3": ("mla", _HALF),  # rope_interleave de-interleaves before caching
}

EXACT_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope", "dynamic", "mrope"}
# Kinds whose inv_freq switches with sequence length: exact only below the switch point.
REGIME_ROPE_TYPES = {"dynamic", "longrope"}


@dataclass(frozen=True)
class KVLayout:
    """How one model caches K/V and applies RoPE. Immutable; ``signature`` identifies it.

    Per layer the cache holds ``k: [k_heads, T, k_dim]`` and ``v: [v_heads, T, v_dim]``; channels
    ``[rope_start, rope_start + rope_dim)`` of tensor ``rope_tensor`` are rotated by position.
    """

    model_type: str
    family: str  # "gqa" (MHA/GQA) or "mla"
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
            f"rope on {self.rope_tensor}[{self.rope_start}:{self.rope_start + self.rope_dim}] {conv}",
            f"{len(self.inv_freqs)} inv_freq table(s), scaling={self.rope_type}",
        ]
        if self.n_pos_axes > 1:
            parts.append(f"M-RoPE {self.n_pos_axes} axes")
        if self.max_exact_position is not None:
            parts.append(f"exact below position {self.max_exact_position}")
        return "; ".join(parts)


def _rotary_dim(cfg: Any, head_dim: int) -> int:
    for attr in ("rotary_dim",):
        val = getattr(cfg, attr, None)
        if val:
            return int(val)
    params = compat.rope_parameters(cfg)
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if factor is None:
        factor = getattr(cfg, "rotary_pct", None)
    if factor is not None and float(factor) < 1.0:
        return int(head_dim * float(factor))
    return head_dim


def _head_dim(cfg: Any) -> int:
    hd = getattr(cfg, "head_dim", None)
    if hd:
        return int(hd)
    return int(cfg.hidden_size // cfg.num_attention_heads)


def _probe_freq_axis(rotary: torch.nn.Module, n_freq: int, interleave_cat: bool = True) -> tuple[int, ...]:
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


def detect_layout(model: torch.nn.Module) -> KVLayout:
    """Read the KV/RoPE layout off a transformers model. Raises UnsupportedLayoutError with the reason
    for anything whose relocation would not be exact."""
    cfg = compat.text_config(model.config)
    model_type = getattr(cfg, "model_type", None) or getattr(model.config, "model_type", "?")
    outer_type = getattr(model.config, "model_type", model_type)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedLayoutError(
            f"model_type {model_type!r} is not a supported layout; supported: "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}. Relocation is only claimed where a test proves "
            "it against transformers' own forward."
        )
    family, interleaved = SUPPORTED_MODEL_TYPES[model_type]
    if getattr(cfg, "use_mla", False):
        family = "mla"
    num_layers = int(cfg.num_hidden_layers)
    notes: list[str] = []

    rotaries = compat.find_rotary_modules(model)
    if not rotaries and model_type == "gptj":
        rotaries = [("gptj", compat.GPTJRotaryTable(cfg))]
    if not rotaries:
        raise UnsupportedLayoutError(f"{model_type}: no rotary embedding module found (no RoPE?)")
    rotary = rotaries[0][1]

    layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * num_layers)
    per_type = any(hasattr(rotary, f"{t}_inv_freq") for t in set(layer_types))

    # --- which tensor / channels rotate
    if family == "mla":
        rope_dim = int(cfg.qk_rope_head_dim)
        lora = int(cfg.kv_lora_rank)
        if compat.mla_cache_contents() == "latent":
            k_heads, k_dim, v_heads, v_dim = 1, lora, 1, rope_dim
            rope_tensor, rope_start = "v", 0
        else:
            nope = int(cfg.qk_nope_head_dim)
            k_heads = v_heads = int(cfg.num_key_value_heads or cfg.num_attention_heads)
            k_dim, v_dim = nope + rope_dim, int(cfg.v_head_dim)
            rope_tensor, rope_start = "k", nope
        if model_type == "deepseek_v3" and not getattr(cfg, "rope_interleave", True):
            interleaved = False
    else:
        head_dim = _head_dim(cfg)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        k_heads = v_heads = kv_heads
        k_dim = v_dim = head_dim
        rope_dim = _rotary_dim(cfg, head_dim)
        rope_tensor, rope_start = "k", 0
        if rope_dim % 2:
            raise UnsupportedLayoutError(f"{model_type}: odd rotary dim {rope_dim}")

    # --- inv_freq tables, per layer
    tables: list[tuple[float, ...]] = []
    layer_table: list[int] = []
    scalings: set[float] = set()
    rope_types: set[str] = set()
    for lt in layer_types[:num_layers]:
        inv = compat.rotary_inv_freq(rotary, lt if per_type else None)
        tup = tuple(float(x) for x in inv.tolist())
        if tup not in tables:
            tables.append(tup)
        layer_table.append(tables.index(tup))
        scalings.add(compat.rotary_attention_scaling(rotary, lt if per_type else None))
        rope_types.add(compat.rope_parameters(cfg, lt if per_type else None).get("rope_type", "default"))
    if len(layer_table) != num_layers:
        raise UnsupportedLayoutError(f"{model_type}: layer_types does not cover every layer")
    n_freq = rope_dim // 2
    for t in tables:
        if len(t) != n_freq:
            raise UnsupportedLayoutError(
                f"{model_type}: inv_freq has {len(t)} frequencies but the rotary slice has {rope_dim} channels"
            )
    rope_type = sorted(rope_types)[0] if len(rope_types) == 1 else "+".join(sorted(rope_types))
    for rt in rope_types:
        if rt not in EXACT_ROPE_TYPES:
            raise UnsupportedLayoutError(f"{model_type}: RoPE scaling {rt!r} is not supported for exact relocation")

    # --- regime limit: dynamic NTK / LongRoPE switch inv_freq past a length
    max_exact: int | None = None
    if rope_types & REGIME_ROPE_TYPES:
        params = compat.rope_parameters(cfg)
        if "longrope" in rope_types:  # long factors once max(position)+1 > original length
            max_exact = int(params.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        else:  # dynamic NTK grows inv_freq once max(position)+1 > max_position_embeddings
            max_exact = int(cfg.max_position_embeddings)
        notes.append(f"{rope_type}: inv_freq switches at {max_exact} tokens; relocation refused beyond it")

    table_limit = getattr(rotary, "max_positions", None)
    if table_limit is not None:  # a precomputed sin/cos table (GPT-J) ends at n_positions
        max_exact = int(table_limit) if max_exact is None else min(max_exact, int(table_limit))
        notes.append(f"sin/cos table ends at position {table_limit}")

    # --- M-RoPE
    n_axes, freq_axis = 1, None
    params0 = compat.rope_parameters(cfg)
    if params0.get("mrope_section") is not None:
        n_axes = 3
        freq_axis = _probe_freq_axis(rotary, n_freq)

    # --- sliding layers
    sw = getattr(cfg, "sliding_window", None)
    sliding = tuple(int(sw) if (t == "sliding_attention" and sw) else None for t in layer_types[:num_layers])

    dtype = next(model.parameters()).dtype
    return KVLayout(
        model_type=outer_type if outer_type != model_type and model_type.endswith("_text") else model_type,
        family=family,
        num_layers=num_layers,
        k_heads=k_heads,
        k_dim=k_dim,
        v_heads=v_heads,
        v_dim=v_dim,
        rope_tensor=rope_tensor,
        rope_start=rope_start,
        rope_dim=rope_dim,
        interleaved=interleaved,
        inv_freqs=tuple(tables),
        layer_table=tuple(layer_table),
        rope_type=rope_type,
        attention_scaling=max(scalings),
        n_pos_axes=n_axes,
        freq_axis=freq_axis,
        max_exact_position=max_exact,
        sliding_windows=sliding,
        compute_dtype=str(dtype).replace("torch.", ""),
        notes=tuple(notes),
        max_trained_position=_trained_length(cfg),
    )


def _trained_length(cfg: Any) -> int | None:
    """The context length the model was trained for (``max_position_embeddings``; for LongRoPE
    the extended length it was trained to), or None when the config does not say."""
    n = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return int(n) if isinstance(n, int) and n > 0 else None
