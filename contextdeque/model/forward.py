"""One forward of a transformers model at explicit positions after an explicit past, returning the
new tokens' cached KV: the single entry point used by :class:`~contextdeque.model.hf.HFBackend`
(encode, patches, the re-prefill oracle) and by the structural probe of
:mod:`contextdeque.model.detect`.

A model whose cache does not hold per-token keys and values (recurrent / state-space / linear
attention layers, or no cache at all) is refused here with :class:`UnsupportedLayoutError` naming
what it caches instead.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

import torch

from ..core import compat
from ..core.errors import EmptyChunkError, UnsupportedLayoutError
from ..core.kv import LayerKV


@lru_cache(maxsize=None)
def _accepts(cls: type, name: str) -> bool:
    params = inspect.signature(cls.forward).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _layer_kv(cache: Any, idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(keys, values) of cache layer ``idx`` or None when that layer holds another kind of state."""
    layer = cache.layers[idx]
    k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4 or v.dim() != 4:
        return None
    return k, v


def cached_kv(out: Any, past_len: int, n_new: int) -> list[LayerKV]:
    """The new tokens' per-layer ``(k [H, T, d], v [H, T, d])`` from a forward's output.

    Raises:
        UnsupportedLayoutError: ``reason="recurrent"`` when a layer caches a running state instead
            of per-token keys, ``reason="no-kv-cache"`` when the model returns no cache.
    """
    cache = getattr(out, "past_key_values", None)
    if cache is None:
        state = getattr(out, "cache_params", None) or getattr(out, "state", None)
        if state is not None:
            kinds = sorted({type(l).__name__ for l in getattr(state, "layers", [])}) or [type(state).__name__]
            raise UnsupportedLayoutError(
                f"the model caches a recurrent state ({', '.join(kinds)}), not per-token keys and values: "
                "there is nothing a position operator could relocate",
                reason="recurrent",
            )
        raise UnsupportedLayoutError("the model returns no KV cache (use_cache gives none)", reason="no-kv-cache")
    n_layers = len(cache.layers) if hasattr(cache, "layers") else 0
    if n_layers == 0:
        raise UnsupportedLayoutError(
            f"the model's cache ({type(cache).__name__}) holds no per-layer keys and values", reason="no-kv-cache"
        )
    kv: list[LayerKV] = []
    for i in range(n_layers):
        pair = _layer_kv(cache, i)
        if pair is None or pair[0].shape[-2] != past_len + n_new or pair[1].shape[-2] != past_len + n_new:
            layer = cache.layers[i]
            kinds = sorted(n for n, t in vars(layer).items() if isinstance(t, torch.Tensor)) or ["no tensors"]
            raise UnsupportedLayoutError(
                f"cache layer {i} ({type(layer).__name__}: {', '.join(kinds)}) holds a recurrent / state-space "
                "state, not one key and value per token: a running state depends on everything before it "
                "and cannot be relocated",
                reason="recurrent",
            )
        k, v = pair
        kv.append((k[0, :, past_len:, :], v[0, :, past_len:, :]))
    return kv


def position_ids(positions: Any, n_pos_axes: int, device: Any) -> torch.Tensor:
    """A model's ``position_ids`` for one sequence at ``positions`` (``[T]``, ``[1, T]`` or
    ``[n_axes, T]``): ``[n_axes, 1, T]`` for M-RoPE models (a 1-D position is the same on every
    axis), else ``[1, T]``; on ``device``."""
    pos = torch.as_tensor(positions, dtype=torch.long)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if n_pos_axes > 1:
        if pos.shape[0] == 1:
            pos = pos.expand(n_pos_axes, -1)
        return pos.reshape(n_pos_axes, 1, -1).to(device)
    return pos[:1].reshape(1, -1).to(device)


@torch.no_grad()
def run_forward(
    model: torch.nn.Module,
    n_pos_axes: int,
    *,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    positions: torch.Tensor,
    past: list[LayerKV] | None = None,
    logits: str = "last",
) -> tuple[list[LayerKV], torch.Tensor | None]:
    """Prefill ``input_ids [T]`` (or ``inputs_embeds [T, hidden]``) at ``positions [n_axes, T]`` after
    ``past`` (per layer ``(k [H,S,d], v [H,S,d])`` as cached). Returns the new tokens' cached KV and
    the logits asked for (``"last"``, ``"all"`` or ``"none"``: fp32 ``[T', vocab]`` or None)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    if input_ids is not None:
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).reshape(1, -1)
        n = ids.shape[1]
        kwargs: dict[str, Any] = {"input_ids": ids}
    elif inputs_embeds is not None:
        emb = inputs_embeds.to(device, dtype).reshape(1, -1, inputs_embeds.shape[-1])
        n = emb.shape[1]
        kwargs = {"inputs_embeds": emb}
    else:
        raise EmptyChunkError("forward needs input_ids or inputs_embeds")
    if n == 0:
        raise EmptyChunkError("forward over zero tokens")
    pos_ids = position_ids(positions, n_pos_axes, device)
    cls = type(model)
    if not _accepts(cls, "position_ids"):
        raise UnsupportedLayoutError(
            f"{cls.__name__}.forward takes no position_ids: chunks cannot be placed at chosen positions",
            reason="no-positions",
        )
    past_len = 0 if not past else past[0][0].shape[-2]
    cache = compat.cache_from_layers([(k.unsqueeze(0), v.unsqueeze(0)) for k, v in past]) if past else compat.new_cache()
    # an explicit all-ones mask: without it transformers may read a position gap as packed sequences
    kwargs["attention_mask"] = torch.ones(1, past_len + n, dtype=torch.long, device=device)
    if _accepts(cls, "logits_to_keep"):
        kwargs["logits_to_keep"] = {"last": 1, "all": 0, "none": 1}[logits]
    out = model(**kwargs, position_ids=pos_ids, past_key_values=cache, use_cache=True)
    kv = cached_kv(out, past_len, n)
    lg = None
    if logits != "none":
        lg = out.logits[0].to(torch.float32)
        if logits == "last":
            lg = lg[-1:]
    return kv, lg


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The model's decoder stack (the module holding ``layers``), or a clear refusal."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if base is None or not isinstance(getattr(base, "layers", None), torch.nn.ModuleList):
        raise UnsupportedLayoutError(
            f"{type(model).__name__} exposes no decoder layer list: a partial (deep-only) forward needs one",
            reason="no-layers",
        )
    return base


@torch.no_grad()
def run_hidden_at(
    model: torch.nn.Module,
    n_pos_axes: int,
    *,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    past: list[LayerKV] | None,
    layer: int,
) -> torch.Tensor:
    """The hidden state entering decoder layer ``layer`` for ``input_ids [T]`` at ``positions``
    after ``past``: ``[T, hidden]`` (what a deep-only forward, :func:`run_deep_forward`, starts
    from). One full forward (``layer`` 0: the embeddings)."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).reshape(1, -1)
    past_len = 0 if not past else past[0][0].shape[-2]
    cache = compat.cache_from_layers([(k.unsqueeze(0), v.unsqueeze(0)) for k, v in past]) if past else compat.new_cache()
    mask = torch.ones(1, past_len + ids.shape[1], dtype=torch.long, device=device)
    out = _decoder(model)(input_ids=ids, position_ids=position_ids(positions, n_pos_axes, device), attention_mask=mask,
                          past_key_values=cache, use_cache=True, output_hidden_states=True)
    return out.hidden_states[int(layer)][0]


@torch.no_grad()
def run_layers(
    model: torch.nn.Module,
    n_pos_axes: int,
    *,
    hidden: torch.Tensor,
    first_layer: int,
    last_layer: int | None = None,
    positions: torch.Tensor,
    past: list[LayerKV],
) -> tuple[torch.Tensor, list[LayerKV]]:
    """Run decoder layers ``first_layer..last_layer-1`` (``last_layer`` None: to the last) over
    ``hidden [T, hidden]`` (the state entering ``first_layer``) at ``positions`` after ``past``
    (every layer's ``(k [H,S,d], v [H,S,d])`` as cached). Returns the state leaving the last layer
    run, ``[T, hidden]`` (before the final norm; what the next range starts from), and the new
    tokens' KV of the layers run, ``(k [H,T,d], v [H,T,d])`` per layer: a forward split by layer
    ranges (one range per idle gap, ``window.anticipation.ResumableForming``) costs its share of
    the whole and gives the same KV. The layers keep their own indices (each reads and writes its
    own cache layer)."""
    base = _decoder(model)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    layers = base.layers
    L = len(layers)
    last = L if last_layer is None else int(last_layer)
    if not 0 <= int(first_layer) < last <= L:
        raise UnsupportedLayoutError(f"layer range must be within 0..{L}, got {first_layer}..{last}", reason="no-layers")
    past_len = past[0][0].shape[-2] if past else 0
    cache = compat.cache_from_layers([(k.unsqueeze(0), v.unsqueeze(0)) for k, v in past]) if past else compat.new_cache()
    emb = hidden.to(device, dtype).reshape(1, -1, hidden.shape[-1])
    n = emb.shape[1]
    mask = torch.ones(1, past_len + n, dtype=torch.long, device=device)
    leaving: list[torch.Tensor] = []
    hook = layers[last - 1].register_forward_hook(
        lambda _m, _i, out: leaving.append(out[0] if isinstance(out, tuple) else out))
    base.layers = torch.nn.ModuleList(list(layers)[int(first_layer):last])
    try:
        base(inputs_embeds=emb, position_ids=position_ids(positions, n_pos_axes, device), attention_mask=mask,
             past_key_values=cache, use_cache=True)
    finally:
        base.layers = layers
        hook.remove()
    out: list[LayerKV] = []
    for l in range(int(first_layer), last):
        k, v = compat.cache_layer(cache, l)
        out.append((k[0, :, past_len:, :], v[0, :, past_len:, :]))
    return leaving[-1].reshape(n, -1), out


def run_deep_forward(
    model: torch.nn.Module,
    n_pos_axes: int,
    *,
    hidden: torch.Tensor,
    first_layer: int,
    positions: torch.Tensor,
    past: list[LayerKV],
) -> list[LayerKV]:
    """Run only decoder layers ``first_layer..L-1`` over ``hidden [T, hidden]`` (the state entering
    ``first_layer``) at ``positions`` after ``past`` (every layer's ``(k [H,S,d], v [H,S,d])`` as
    cached). Returns the new tokens' KV of the layers run, ``(k [H,T,d], v [H,T,d])`` per layer
    from ``first_layer`` on: a shallow-recompute miss path costs ``(L - first_layer) / L`` of a
    forward (:func:`run_layers` to the last layer)."""
    if not past:
        raise UnsupportedLayoutError("a deep-only forward needs every layer's past", reason="no-layers")
    return run_layers(model, n_pos_axes, hidden=hidden, first_layer=first_layer, positions=positions, past=past)[1]
