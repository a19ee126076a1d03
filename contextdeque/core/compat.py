"""The one module that owns every transformers-version difference contextdeque depends on.

Everything else in contextdeque reads caches, RoPE settings and rotary modules through these
functions, so a transformers upgrade that moves an attribute is fixed here and nowhere else.
Supported range: transformers 5.17-5.18 (the pin in pyproject); branches for versions the pin
excludes are not kept. Seams of the pinned versions handled here:
- configs without ``rope_parameters`` (GPT-J) take ``rope_theta`` / ``rope_scaling`` or the defaults.
- an MLA (DeepSeek-V2/V3) cache layer holds the latent c_KV ``[B,1,T,kv_lora_rank]`` as keys and
  the rotated k_pe ``[B,1,T,rope_dim]`` as values (since 5.1; the structural probe of ``contextdeque.model.detect`` reads it off the cache).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    import transformers


def text_config(config: Any) -> Any:
    """The decoder (text) config of a possibly multimodal config."""
    getter = getattr(config, "get_text_config", None)
    if getter is not None:
        return getter(decoder=True)
    return getattr(config, "text_config", config)


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """RoPE settings as one flat dict with at least ``rope_type`` and ``rope_theta``.

    5.x keeps them in ``config.rope_parameters`` (keyed by layer type for models like Gemma3);
    4.x in ``rope_theta`` + ``rope_scaling``.
    """
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
        if layer_type is not None and layer_type in params and isinstance(params[layer_type], dict):
            params = dict(params[layer_type])
        elif any(isinstance(v, dict) for v in params.values()) and "rope_type" not in params:
            # per-layer-type dict but no layer type asked: take the first (callers ask per type)
            params = dict(next(v for v in params.values() if isinstance(v, dict)))
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    return params


def find_rotary_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every rotary-embedding module (has an ``inv_freq`` or ``<type>_inv_freq`` buffer) of the
    language model, vision towers excluded, in module order."""
    found = []
    for name, module in model.named_modules():
        if "visual" in name.split(".") or "vision" in name.lower():
            continue
        bufs = dict(module.named_buffers(recurse=False))
        if any(b == "inv_freq" or b.endswith("_inv_freq") and not b.endswith("original_inv_freq") for b in bufs):
            found.append((name, module))
    return found


def rotary_inv_freq(module: torch.nn.Module, layer_type: str | None = None) -> torch.Tensor:
    """The raw (unscaled-cos/sin) ``inv_freq`` a rotary module multiplies positions with, fp32 ``[n_freq]``.

    Prefers the ``original_inv_freq`` copy: dynamic RoPE kinds overwrite ``inv_freq`` in place
    once a long sequence has been seen, the original is the short-regime table.
    """
    prefix = f"{layer_type}_" if layer_type else ""
    for name in (f"{prefix}original_inv_freq", f"{prefix}inv_freq"):
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor):
            return t.detach().to(torch.float32).cpu().clone()
    raise AttributeError(f"rotary module {type(module).__name__} has no {prefix}inv_freq")


def rotary_attention_scaling(module: torch.nn.Module, layer_type: str | None = None) -> float:
    """The factor the rotary module multiplies cos/sin with (YaRN/LongRoPE != 1)."""
    prefix = f"{layer_type}_" if layer_type else ""
    val = getattr(module, f"{prefix}attention_scaling", None)
    if val is None:
        val = getattr(module, "attention_scaling", 1.0)
    if isinstance(val, dict):
        val = val.get(layer_type, 1.0)
    return float(val)


def sinusoid_tables(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, int]]:
    """Precomputed sin/cos position tables kept instead of a rotary module (GPT-J and CodeGen keep
    one per attention layer), as ``(buffer name, exact fp32 inv_freq, n_positions)``.

    A buffer ``[P, D]`` whose row 0 is ``cat(sin 0, cos 0)`` is such a table; its base is read off
    row 1 and accepted only if rebuilding the table from it the way transformers does
    (``fp32(arange(P)) * fp32(1 / base^(2i/D))``) reproduces every entry bit for bit."""
    found: list[tuple[str, torch.Tensor, int]] = []
    seen: set[tuple[int, int, int]] = set()
    for name, buf in model.named_buffers():
        if buf.dim() != 2 or not buf.is_floating_point() or buf.shape[1] % 2 or buf.shape[0] < 2 or buf.shape[1] < 4:
            continue
        table = buf.detach().to(torch.float32).cpu()
        half = table.shape[1] // 2
        if not (torch.all(table[0, :half] == 0) and torch.all(table[0, half:] == 1)):
            continue
        freq = torch.atan2(table[1, :half].double(), table[1, half:].double())
        if not 0 < float(freq[1]) < 1:
            continue
        dim = table.shape[1]
        base = round(float(freq[1]) ** (-dim / 2))
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
        angles = torch.einsum("i , j -> i j", torch.arange(table.shape[0], dtype=torch.int64).float(), inv).float()
        if not torch.equal(torch.cat((torch.sin(angles), torch.cos(angles)), dim=1), table):
            continue
        key = (table.shape[0], dim, base)
        if key not in seen:
            seen.add(key)
            found.append((name, inv.to(torch.float32), int(table.shape[0])))
    return found


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The language model's decoder-layer list (``model.model.layers`` for Llama-like models)."""
    n = int(text_config(model.config).num_hidden_layers)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n and name.endswith("layers"):
            if "visual" in name.split(".") or "vision" in name.lower():
                continue
            return module
    from .errors import UnsupportedLayoutError

    raise UnsupportedLayoutError(f"cannot find the {n} decoder layers of {type(model).__name__}")


# --------------------------------------------------------------------------- caches


def new_cache(config: Any | None = None) -> transformers.DynamicCache:
    """An empty DynamicCache. Without a config every layer keeps every token (also sliding
    layers), which is what chunk encoding wants; with one, sliding layers truncate."""
    import transformers  # (not at import: what only reads keys -- the replay -- never loads it)

    if config is None:
        return transformers.DynamicCache()
    return transformers.DynamicCache(config=config)


def cache_num_layers(cache: Any) -> int:
    return len(cache.layers)


def cache_layer(cache: Any, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) of cache layer ``idx``, each ``[batch, heads, seq, dim]``."""
    layer = cache.layers[idx]
    return layer.keys, layer.values


def cache_from_layers(
    layers: list[tuple[torch.Tensor, torch.Tensor]], config: Any | None = None
) -> transformers.DynamicCache:
    """A DynamicCache holding the given per-layer (keys, values), each ``[batch, heads, seq, dim]``.

    Uses the cache's own ``update`` so every bookkeeping field (initialized flag, dtype, device,
    sliding cumulative length) stays true; sliding layers (when ``config`` is given) keep only
    their window like a real prefill would.
    """
    cache = new_cache(config)
    for idx, (k, v) in enumerate(layers):
        cache.update(k, v, idx)
    return cache
