"""Operations on formed patches: cutting one to a lower rank, pooling several into one (the orbit
patch of a set of exact patches), and forming one straight from conditioned KV that some forward
already cached (no forward of its own)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from ..core.errors import FingerprintMismatchError, PatchError
from ..core.kv import LayerKV
from ..core.operator import to_content_frame
from .base import PATCH_KINDS, FormContext, Patch, new_patch
from .topm import truncated_svd
from .factors import mix_factors
from .keys import antecedent_signature
from .rank import is_full, rank_cap, resolve_rank


def _full_rank(patch: Patch, which: str) -> int:
    h, d = patch.k_shape if which == "k" else patch.v_shape
    return rank_cap(patch.n_tokens, h * d)


def truncate_patch(patch: Patch, rank: int | str | None, rank_v: int | str | None = None) -> Patch:
    """``patch`` cut to its top ``rank`` (K) / ``rank_v`` (V, default ``rank``) directions (per
    layer: a layer holding fewer keeps what it holds).

    ``"full"``/None keeps everything. A rank above what the patch holds is allowed only when the
    patch is full rank (it already is the exact Δ); otherwise :class:`PatchError`.
    """
    rank_v = rank if rank_v is None else rank_v

    def cut(have: int, want: int | str | None, full: int, what: str) -> int:
        if is_full(want):
            return have
        w = int(want)
        if w < 0:
            raise PatchError(f"{what} rank must be >= 0, got {w}")
        if w > have and have < full:
            raise PatchError(f"cannot raise a rank-{have} patch to rank {w} ({what}); form it at that rank")
        return min(w, have)

    mk = cut(patch.rank_k, rank, _full_rank(patch, "k"), "K")
    mv = cut(patch.rank_v, rank_v, _full_rank(patch, "v"), "V")
    if mk == patch.rank_k and mv == patch.rank_v:
        return patch
    have_k, have_v = patch.layer_ranks
    return cut_patch(patch, [min(mk, r) for r in have_k], [min(mv, r) for r in have_v])


def cut_patch(patch: Patch, ranks_k: Sequence[int], ranks_v: Sequence[int]) -> Patch:
    """``patch`` cut to per-layer ranks (one K and one V rank per layer of ``patch.layers``, each at
    most what that layer holds; its top directions are kept: an SVD truncated is the top-m SVD).

    Layers cut to rank 0 in both K and V are dropped (a layer-sparse patch); equal ranks on every
    kept layer give the stacked form, unequal ones the flat form (see :class:`Patch`)."""
    if patch.basis_id is not None and (len(set(ranks_k)) > 1 or len(set(ranks_v)) > 1):
        raise PatchError("a shared-basis patch takes one rank per K/V, not per-layer ranks")
    have_k, have_v = patch.layer_ranks
    n = len(patch.layers)
    if len(ranks_k) != n or len(ranks_v) != n:
        raise PatchError(f"need one K and one V rank per layer ({n}), got {len(ranks_k)} and {len(ranks_v)}")
    for want, have, what in ((ranks_k, have_k, "K"), (ranks_v, have_v, "V")):
        if any(int(w) < 0 or int(w) > h for w, h in zip(want, have)):
            raise PatchError(f"{what} ranks {list(want)} must be within what the patch holds per layer ({list(have)})")
    keep = [i for i in range(n) if ranks_k[i] or ranks_v[i]]
    rk, rv = [int(ranks_k[i]) for i in keep], [int(ranks_v[i]) for i in keep]
    if patch.mixed is not None:  # each kept direction stays at the precision it was stored at
        empty = torch.zeros(0, dtype=patch.k_u.dtype)
        return new_patch(
            patch, kind=patch.kind, antecedents=patch.antecedents, signature=patch.antecedent_signature,
            ranks=(max(rk, default=0), max(rv, default=0)), layers=[patch.layers[i] for i in keep],
            factors=(empty, empty, empty, empty), meta=patch.meta, layer_ranks=(rk, rv),
            mixed=patch.mixed.cut(keep, rk, rv))
    blocks: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"k": [], "v": []}
    for i in keep:
        for which, m in (("k", ranks_k[i]), ("v", ranks_v[i])):
            u, w = patch.layer_factors(which, i)
            blocks[which].append((u[:, :m], w[:m]))
    uniform = len(set(rk)) <= 1 and len(set(rv)) <= 1
    factors = []
    for which in ("k", "v"):
        us = [u for u, _ in blocks[which]]
        ws = [w for _, w in blocks[which]]
        if uniform:  # the stacked form [n, T, m] / [n, m, F]
            factors += [torch.stack(us) if us else torch.zeros(0, 0, 0, dtype=patch.k_u.dtype),
                        torch.stack(ws) if ws else torch.zeros(0, 0, 0, dtype=patch.k_u.dtype)]
        else:  # the flat form: each layer's block contiguous, one after another
            factors += [torch.cat([u.reshape(-1) for u in us]), torch.cat([w.reshape(-1) for w in ws])]
    return new_patch(
        patch, kind=patch.kind, antecedents=patch.antecedents, signature=patch.antecedent_signature,
        ranks=(max(rk, default=0), max(rv, default=0)), layers=[patch.layers[i] for i in keep],
        factors=(factors[0], factors[1], factors[2], factors[3]), basis_id=patch.basis_id, meta=patch.meta,
        layer_ranks=None if uniform else (rk, rv),
    )


def mix_patch(patch: Patch, precisions_k: Sequence[Sequence[str]], precisions_v: Sequence[Sequence[str]]) -> Patch:
    """``patch`` cut to its top ``len(precisions_k[i])`` K / ``len(precisions_v[i])`` V directions
    per layer (index ``i`` into ``patch.layers``), each stored at the precision named
    (:mod:`contextdeque.patch.factors`: ``hi`` is the patch's own dtype, ``int8`` / ``int4``
    quantized with per-vector scales). Layers left with no direction are dropped.

    Raises:
        PatchError: a shared-basis or already mixed patch, or precisions that do not fit it."""
    if patch.basis_id is not None or patch.mixed is not None:
        raise PatchError("mix_patch takes a patch with plain factors (not a shared-basis or mixed one)")
    n = len(patch.layers)
    if len(precisions_k) != n or len(precisions_v) != n:
        raise PatchError(f"need K and V precisions for each of the {n} layers, got {len(precisions_k)} and {len(precisions_v)}")
    have_k, have_v = patch.layer_ranks
    if any(len(p) > h for p, h in zip(precisions_k, have_k)) or any(len(p) > h for p, h in zip(precisions_v, have_v)):
        raise PatchError("more precisions than the patch holds directions in a layer")
    keep = [i for i in range(n) if precisions_k[i] or precisions_v[i]]
    blocks: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"k": [], "v": []}
    chosen: dict[str, list[Sequence[str]]] = {"k": [], "v": []}
    for i in keep:
        for which, prec in (("k", precisions_k[i]), ("v", precisions_v[i])):
            u, w = patch.layer_factors(which, i)
            blocks[which].append((u[:, :len(prec)], w[:len(prec)]))
            chosen[which].append(list(prec))
    mixed = mix_factors(blocks, chosen, patch.k_u.dtype, patch.n_tokens, {"k": patch._width("k"), "v": patch._width("v")})
    empty = torch.zeros(0, dtype=patch.k_u.dtype)
    rk, rv = list(mixed.ranks["k"]), list(mixed.ranks["v"])
    return new_patch(
        patch, kind=patch.kind, antecedents=patch.antecedents, signature=patch.antecedent_signature,
        ranks=(max(rk, default=0), max(rv, default=0)), layers=[patch.layers[i] for i in keep],
        factors=(empty, empty, empty, empty), meta=patch.meta, layer_ranks=(rk, rv), mixed=mixed)


def combine_patches(
    patches: Sequence[Patch], rank: int | str | None, rank_v: int | str | None = None, kind: str = "orbit"
) -> Patch:
    """One patch from the mean of several patches' deltas (same chunk), re-factorized at ``rank``.

    With full-rank exact patches of every ordering of an antecedent set this is the orbit patch
    (paper §5); leaving the test ordering out gives the held-out orbit the paper measures.
    Layers: those every patch carries. Returns factors in the first patch's storage dtype.
    """
    if not patches:
        raise PatchError("combine_patches needs at least one patch")
    p0 = patches[0]
    for p in patches[1:]:
        if p.chunk_id != p0.chunk_id or p.fingerprint != p0.fingerprint:
            raise PatchError("combine_patches needs patches of one chunk and one model")
    layers = tuple(l for l in p0.layers if all(l in p.layers for p in patches))
    T = p0.n_tokens
    (hk, dk_), (hv, dv_) = p0.k_shape, p0.v_shape
    mk = resolve_rank(rank, T, hk * dk_, "K")
    mv = resolve_rank(rank if rank_v is None else rank_v, T, hv * dv_, "V")
    mean_k, mean_v = [], []
    for l in layers:
        sk = sv = None
        for p in patches:
            dk, dv = p.layer_delta(l)
            sk = dk if sk is None else sk + dk
            sv = dv if sv is None else sv + dv
        mean_k.append((sk / len(patches)).transpose(0, 1).reshape(T, -1))
        mean_v.append((sv / len(patches)).transpose(0, 1).reshape(T, -1))
    ku, kw = truncated_svd(torch.stack(mean_k), mk)
    vu, vw = truncated_svd(torch.stack(mean_v), mv)
    ids = sorted({a for p in patches for a in p.antecedents})
    return new_patch(
        p0, kind=kind, antecedents=ids, signature=antecedent_signature(ids, ordered=False), ranks=(mk, mv),
        layers=layers, factors=(ku, kw, vu, vw), dtype=p0.k_u.dtype,
        meta={"combined_from": str(len(patches))},
    )


def patch_from_conditioned(
    backend: Any,
    chunk: "Any",
    kv: Sequence[LayerKV],
    start: int,
    antecedent_ids: Sequence[str] = (),
    rank: int | str | None = "full",
    rank_v: int | str | None = None,
    kind: str = "exact",
) -> Patch:
    """A patch straight from the chunk's conditioned KV as some forward cached it (the paper's App. A:
    ``forward(prefix, A, B).kv[B] - R(δ)·canonical``, then the top-``rank`` SVD).

    ``kv``: per layer ``(k [H_k, T, d_k], v [H_v, T, d_v])`` of the chunk's rows (rotated, at
    ``chunk.positions(start)``), e.g. sliced from a re-prefill of the whole window — one forward
    then yields every chunk's exact patch. ``kind`` names how the patch is recorded (the target is
    this exact conditioning).
    """
    if chunk.fingerprint != backend.fingerprint or chunk.layout_signature != backend.layout.signature:
        raise FingerprintMismatchError(f"chunk {chunk.id[:12]} was encoded by another model")
    if kind not in PATCH_KINDS:
        raise PatchError(f"unknown patch kind {kind!r}; known: {sorted(PATCH_KINDS)}")
    if kv[0][0].shape[1] != chunk.n_tokens:
        raise PatchError(f"{kv[0][0].shape[1]} KV rows for a chunk of {chunk.n_tokens} tokens")
    lay = backend.layout
    pos = chunk.positions(start)
    keys, values = to_content_frame(list(kv), lay, pos)
    ctx = FormContext(backend=backend, chunk=chunk, antecedents=[], options={})
    dk, dv = ctx.deltas_against(keys, values)
    T = chunk.n_tokens
    rk = resolve_rank(rank, T, lay.k_heads * lay.k_dim, "K")
    rv = resolve_rank(rank if rank_v is None else rank_v, T, lay.v_heads * lay.v_dim, "V")
    layers = tuple(range(chunk.num_layers))
    k_u, k_w, v_u, v_w, _ = PATCH_KINDS["exact"]().factorize(ctx, dk, dv, rk, rv, layers)
    return new_patch(
        chunk, kind=kind, antecedents=antecedent_ids,
        signature=antecedent_signature(list(antecedent_ids), ordered=PATCH_KINDS[kind].ordered),
        ranks=(rk, rv), layers=layers, factors=(k_u, k_w, v_u, v_w), layout=lay, dtype=chunk.storage_dtype,
    )
