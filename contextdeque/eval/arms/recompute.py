"""In-context token recompute: the machinery behind every token-recompute arm.

The strongest form of CacheBlend / EPIC / MPIC / VLCache (the paper's §6 protocol): the selected
tokens are re-prefilled *attending to the full assembled KV* — every other token's reused KV, and
the selected tokens' own fresh KV — with causality by sequence order, and their KV is replaced.

One forward does it. The selected tokens are the new queries; the past is the assembled cache
minus their stale rows; a custom 4-D mask lets new token ``i`` see past row ``j`` iff ``j`` comes
before ``i`` in the sequence and new token ``j`` iff ``j <= i``. Per-layer budgets (VLCache) use
*ghost* rows: at a layer where a selected token is not recomputed, the cache hands attention its
reused KV instead of the fresh one, so the other tokens at that layer see exactly what VLCache's
layer-skipping would give them. A partial pass (CacheBlend's check layer) stops the forward after
a given layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ...core import compat
from ...core.compat import decoder_layers
from ...core.errors import ReuseArmError
from ...core.kv import LayerKV
from .base import ReuseRequest


class _StopForward(Exception):
    """Raised by a pre-hook to end a partial forward after the check layer."""


@functools.cache
def _ghost_cache_class() -> type:
    """The ghost cache class, built on first use (importing the arms -- the replay does, for their
    names -- does not load transformers)."""
    import transformers

    class _GhostCache(transformers.DynamicCache):
        """A DynamicCache whose ``update`` swaps chosen new rows for given reused KV before attention.

        ``ghost[layer] = (mask [q] bool, k_old [1, H_k, q, d_k], v_old [1, H_v, q, d_v])``: rows where
        ``mask`` is True enter that layer's attention (and the cache) with the old KV.
        """

        def __init__(self) -> None:
            super().__init__()
            self.ghost: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
            g = self.ghost.get(layer_idx)
            if g is not None:
                mask, k_old, v_old = g
                sel = mask.view(1, 1, -1, 1)
                key_states = torch.where(sel, k_old.to(key_states.dtype), key_states)
                value_states = torch.where(sel, v_old.to(value_states.dtype), value_states)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return _GhostCache


def _sliding_window(model: torch.nn.Module) -> int | None:
    """The sliding window if any decoder layer uses one (Gemma-style ``layer_types``)."""
    cfg = compat.text_config(model.config)
    types = getattr(cfg, "layer_types", None) or []
    if any(t == "sliding_attention" for t in types):
        return int(getattr(cfg, "sliding_window"))
    return None


def build_mask(
    q_index: torch.Tensor, kv_index: torch.Tensor, dtype: torch.dtype, sliding_window: int | None = None
) -> torch.Tensor:
    """Additive ``[1, 1, q, P + q]`` mask (0 = attend, dtype min = blocked).

    New token ``i`` (sequence index ``q_index[i]``) sees past row ``j`` iff ``kv_index[j] <
    q_index[i]`` and new token ``j`` iff ``q_index[j] <= q_index[i]``; with a sliding window also
    only keys less than ``sliding_window`` indices back (transformers' own overlay).
    """
    keys = torch.cat([kv_index, q_index])
    q = q_index.unsqueeze(1)
    allowed = keys.unsqueeze(0) <= q
    allowed[:, : kv_index.numel()] &= kv_index.unsqueeze(0) < q  # strict for past rows (never a stale self)
    if sliding_window is not None:
        allowed &= (q - keys.unsqueeze(0)) < sliding_window
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.view(1, 1, *allowed.shape)


@torch.no_grad()
def masked_forward(
    backend: Any,
    *,
    inputs: dict[str, torch.Tensor],
    positions: torch.Tensor,
    past: list[LayerKV],
    q_index: torch.Tensor,
    kv_index: torch.Tensor,
    ghost: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    stop_after: int | None = None,
) -> list[LayerKV]:
    """Prefill new tokens among an existing cache with causality by sequence index.

    ``inputs``: ``{"input_ids": [q]}`` or ``{"inputs_embeds": [q, hidden]}``; ``positions``:
    ``[n_axes, q]``; ``past``: per layer ``(k [H, P, d], v [H, P, d])`` (rotated, any order);
    ``q_index [q]`` / ``kv_index [P]``: sequence indices of the new tokens and the past rows.
    ``ghost``: per layer ``(mask [q] bool, k_old [H, q, d], v_old [H, q, d])`` rows that enter
    attention with reused KV. ``stop_after``: last layer to compute (partial pass).
    Returns the new tokens' KV per computed layer, ``(k [H, q, d], v [H, q, d])``.
    """
    model = backend.model
    dev, dt = backend.device, backend.dtype
    if "input_ids" in inputs:
        ids = torch.as_tensor(inputs["input_ids"], dtype=torch.long, device=dev).reshape(1, -1)
        kwargs: dict[str, Any] = {"input_ids": ids}
        n = ids.shape[1]
    else:
        emb = inputs["inputs_embeds"].to(dev, dt)
        kwargs = {"inputs_embeds": emb.reshape(1, -1, emb.shape[-1])}
        n = emb.shape[0]
    position_ids = backend.position_ids(positions)
    cache = _ghost_cache_class()()
    for idx, (k, v) in enumerate(past):
        cache.update(k.unsqueeze(0).to(dev), v.unsqueeze(0).to(dev), idx)
    if ghost:
        cache.ghost = {
            l: (m.to(dev), ko.unsqueeze(0).to(dev), vo.unsqueeze(0).to(dev)) for l, (m, ko, vo) in ghost.items()
        }
    p_len = past[0][0].shape[1] if past else 0
    window = _sliding_window(model)
    mask = build_mask(q_index.cpu(), kv_index.cpu(), dt).to(dev)
    if window is not None:
        attn_mask: Any = {
            "full_attention": mask,
            "sliding_attention": build_mask(q_index.cpu(), kv_index.cpu(), dt, window).to(dev),
        }
    else:
        attn_mask = mask
    hook = None
    n_layers = len(past) if past else int(compat.text_config(model.config).num_hidden_layers)
    if stop_after is not None and stop_after < n_layers - 1:
        def _stop(*_a: Any, **_k: Any) -> None:
            raise _StopForward

        hook = decoder_layers(model)[stop_after + 1].register_forward_pre_hook(_stop)
    try:
        model(**kwargs, position_ids=position_ids, past_key_values=cache, attention_mask=attn_mask,
              use_cache=True, logits_to_keep=1)
    except _StopForward:
        pass
    finally:
        if hook is not None:
            hook.remove()
    backend.count_forward(n)
    last = n_layers - 1 if stop_after is None else min(stop_after, n_layers - 1)
    out = []
    for l in range(last + 1):
        k, v = compat.cache_layer(cache, l)
        out.append((k[0, :, p_len:, :], v[0, :, p_len:, :]))
    return out


@dataclass
class RecomputeStats:
    """Cost of one in-context recompute: ``tokens`` re-prefilled, ``token_layers`` whose KV was
    replaced (VLCache's skipped layers not counted), ``replaced`` distinct tokens replaced."""

    tokens: int
    token_layers: int
    replaced: int


def recompute_in_context(
    request: ReuseRequest,
    base_kv: list[LayerKV],
    select: torch.Tensor,
    keep: Sequence[torch.Tensor] | None = None,
) -> tuple[list[LayerKV], RecomputeStats]:
    """Recompute chunk tokens ``select`` (indices into ``0..N-1``, any order) in context of ``base_kv``.

    ``base_kv``: the assembled cache, per layer ``[H, R + N, d]``. ``keep``: optional per layer a
    ``[len(select)]`` bool of which selected tokens get their KV replaced at that layer (the rest
    enter that layer's attention with their reused KV); default: all, at every layer.
    Returns the new assembled cache (``base_kv`` is not modified) and the cost.
    """
    L = len(base_kv)
    sel = torch.unique(torch.as_tensor(select, dtype=torch.long))
    if sel.numel() == 0:
        return [(k.clone(), v.clone()) for k, v in base_kv], RecomputeStats(0, 0, 0)
    if keep is not None:
        order = torch.argsort(torch.as_tensor(select, dtype=torch.long))
        if len(keep) != L:
            raise ReuseArmError(f"keep needs one mask per layer ({L}), got {len(keep)}")
        keep = [torch.as_tensor(m, dtype=torch.bool)[order] for m in keep]
        if torch.as_tensor(select).numel() != sel.numel():
            raise ReuseArmError("select holds duplicate tokens while per-layer keep masks were given")
    N = request.n_chunk_tokens
    if int(sel.min()) < 0 or int(sel.max()) >= N:
        raise ReuseArmError(f"selected token index out of range 0..{N - 1}")
    R = request.root_len
    seq_sel = sel + R
    total = R + N
    rest = torch.ones(total, dtype=torch.bool)
    rest[seq_sel] = False
    kv_index = torch.nonzero(rest).squeeze(1)
    past = [(k[:, kv_index], v[:, kv_index]) for k, v in base_kv]
    ghost = None
    if keep is not None:
        ghost = {}
        for l in range(L):
            if not bool(keep[l].all()):
                ghost[l] = (~keep[l], base_kv[l][0][:, seq_sel], base_kv[l][1][:, seq_sel])
    new = masked_forward(
        request.backend,
        inputs=request.inputs(sel),
        positions=request.positions()[:, sel],
        past=past,
        q_index=seq_sel,
        kv_index=kv_index,
        ghost=ghost,
    )
    out: list[LayerKV] = []
    token_layers = 0
    replaced = torch.zeros(sel.numel(), dtype=torch.bool)
    for l, (k, v) in enumerate(base_kv):
        k2, v2 = k.clone(), v.clone()
        nk, nv = new[l]
        if keep is None:
            k2[:, seq_sel] = nk.to(k2.dtype)
            v2[:, seq_sel] = nv.to(v2.dtype)
            token_layers += sel.numel()
            replaced[:] = True
        else:
            m = keep[l]
            k2[:, seq_sel[m]] = nk[:, m].to(k2.dtype)
            v2[:, seq_sel[m]] = nv[:, m].to(v2.dtype)
            token_layers += int(m.sum())
            replaced |= m
        out.append((k2, v2))
    return out, RecomputeStats(tokens=int(sel.numel()), token_layers=token_layers, replaced=int(replaced.sum()))


def check_layer_kv(request: ReuseRequest, check_layer: int) -> LayerKV:
    """CacheBlend's check pass: every chunk token prefilled in context (after the root) through
    layers ``0..check_layer`` only. Returns that layer's ``(k [H, N, d], v [H, N, d])``."""
    L = request.num_layers
    if not 0 <= check_layer < L:
        raise ReuseArmError(f"check layer {check_layer} outside 0..{L - 1}")
    R, N = request.root_len, request.n_chunk_tokens
    new = masked_forward(
        request.backend,
        inputs=request.inputs(),
        positions=request.positions(),
        past=request.backend.root_kv(),
        q_index=torch.arange(R, R + N),
        kv_index=torch.arange(R),
        stop_after=check_layer,
    )
    return new[check_layer]
