"""Patch: relocate every chunk and add its rank-m conditioning patch (zero serve-time forwards).

The leading chunk has no antecedent (``KV(B|root)`` is already exact) and carries no patch; chunk
``i`` carries a patch of kind ``kind`` formed on chunks ``0..i-1`` (with their own patches when
``chain``, as a window would hold them). Patches handed in with the request are used instead —
truncated to this arm's rank when they are of higher rank (an SVD truncated is the top-m SVD).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from ...core.errors import FingerprintMismatchError, PatchError, ReuseArmError
from ...core.kv import LayerKV
from ...core.operator import relocate, to_content_frame
from ...patch import PATCH_KINDS, Patch, antecedent_signature, form_patch
from ...patch.base import FormContext, resolve_rank, truncated_svd
from .base import ArmResult, ReuseArm, ReuseRequest
from ...core.kv import concat_kv


def _full_rank(patch: Patch, which: str) -> int:
    h, d = patch.k_shape if which == "k" else patch.v_shape
    return min(patch.n_tokens, h * d)


def truncate_patch(patch: Patch, rank: int | str | None, rank_v: int | str | None = None) -> Patch:
    """``patch`` cut to its top ``rank`` (K) / ``rank_v`` (V, default ``rank``) directions.

    ``"full"``/None keeps everything. A rank above what the patch holds is allowed only when the
    patch is full rank (it already is the exact Δ); otherwise :class:`ReuseArmError`.
    """
    rank_v = rank if rank_v is None else rank_v

    def cut(have: int, want: int | str | None, full: int, what: str) -> int:
        if want is None or want == "full" or want == -1:
            return have
        w = int(want)
        if w < 0:
            raise ReuseArmError(f"{what} rank must be >= 0, got {w}")
        if w > have and have < full:
            raise ReuseArmError(f"cannot raise a rank-{have} patch to rank {w} ({what}); form it at that rank")
        return min(w, have)

    mk = cut(patch.rank_k, rank, _full_rank(patch, "k"), "K")
    mv = cut(patch.rank_v, rank_v, _full_rank(patch, "v"), "V")
    if mk == patch.rank_k and mv == patch.rank_v:
        return patch
    return dataclasses.replace(
        patch,
        rank_k=mk,
        rank_v=mv,
        k_u=patch.k_u[..., :mk].contiguous(),
        k_w=patch.k_w[:, :mk].contiguous(),
        v_u=patch.v_u[..., :mv].contiguous(),
        v_w=patch.v_w[:, :mv].contiguous(),
    )


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
    rk_full, rv_full = min(T, hk * dk_), min(T, hv * dv_)

    def res(r: int | str | None, full: int) -> int:
        if r is None or r == "full" or r == -1:
            return full
        if int(r) > full:
            raise PatchError(f"rank {r} exceeds min(T, F) = {full}")
        return int(r)

    mk, mv = res(rank, rk_full), res(rank if rank_v is None else rank_v, rv_full)
    ku, kw, vu, vw = [], [], [], []
    for l in layers:
        sk = sv = None
        for p in patches:
            dk, dv = p.layer_delta(l)
            sk = dk if sk is None else sk + dk
            sv = dv if sv is None else sv + dv
        mean_k = (sk / len(patches)).transpose(0, 1).reshape(T, -1)
        mean_v = (sv / len(patches)).transpose(0, 1).reshape(T, -1)
        u, w = truncated_svd(mean_k, mk)
        ku.append(u), kw.append(w)
        u, w = truncated_svd(mean_v, mv)
        vu.append(u), vw.append(w)
    sdt = p0.k_u.dtype
    ids = sorted({a for p in patches for a in p.antecedents})
    return Patch(
        chunk_id=p0.chunk_id,
        fingerprint=p0.fingerprint,
        layout_signature=p0.layout_signature,
        antecedent_signature=antecedent_signature(ids, ordered=False),
        antecedents=tuple(ids),
        kind=kind,
        rank_k=mk,
        rank_v=mv,
        n_tokens=T,
        layers=layers,
        k_u=torch.stack(ku).to(sdt),
        k_w=torch.stack(kw).to(sdt),
        v_u=torch.stack(vu).to(sdt),
        v_w=torch.stack(vw).to(sdt),
        k_shape=p0.k_shape,
        v_shape=p0.v_shape,
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
    sdt = chunk.storage_dtype
    return Patch(
        chunk_id=chunk.id,
        fingerprint=chunk.fingerprint,
        layout_signature=chunk.layout_signature,
        antecedent_signature=antecedent_signature(list(antecedent_ids), ordered=PATCH_KINDS[kind].ordered),
        antecedents=tuple(antecedent_ids),
        kind=kind,
        rank_k=rk,
        rank_v=rv,
        n_tokens=T,
        layers=layers,
        k_u=k_u.to(sdt),
        k_w=k_w.to(sdt),
        v_u=v_u.to(sdt),
        v_w=v_w.to(sdt),
        k_shape=(lay.k_heads, lay.k_dim),
        v_shape=(lay.v_heads, lay.v_dim),
    )


class PatchArm(ReuseArm):
    """Blind relocation plus a rank-``rank`` conditioning patch on every non-leading chunk.

    ``rank``: K rank (``"full"`` = exact Δ); ``rank_v``: V rank (default ``rank``); ``kind``: a
    patch kind (exact, orbit, recall, deep, shared, removal); ``chain``: form each patch with the
    antecedents' own patches applied; other keyword options go to :func:`form_patch`.
    """

    name = "patch"

    def __init__(
        self,
        rank: int | str = 32,
        *,
        rank_v: int | str | None = None,
        kind: str = "exact",
        chain: bool = True,
        label: str | None = None,
        **kind_options: Any,
    ) -> None:
        super().__init__(label=label or f"patch-r{rank}")
        self.rank, self.rank_v, self.kind, self.chain = rank, rank_v, kind, chain
        self.kind_options = kind_options

    def patches(self, request: ReuseRequest) -> tuple[list[list[Patch]], int]:
        """The patches applied to every chunk and the conditioned forwards spent forming them."""
        be = request.backend
        before = be.forwards_run
        out: list[list[Patch]] = []
        for i, chunk in enumerate(request.chunks):
            given = request.patches_for(i)
            if given:
                out.append([truncate_patch(p, self.rank, self.rank_v) for p in given])
            elif i == 0:
                out.append([])
            else:
                ants = [(request.chunks[j], out[j] if self.chain else None) for j in range(i)]
                out.append([form_patch(be, chunk, ants, rank=self.rank, kind=self.kind, rank_v=self.rank_v,
                                       **self.kind_options)])
        return out, be.forwards_run - before

    def run(self, request: ReuseRequest) -> ArmResult:
        pats, compile_fw = self.patches(request)
        lay = request.backend.layout
        parts = [request.backend.root_kv()]
        for i, (chunk, start) in enumerate(zip(request.chunks, request.starts)):
            parts.append(relocate(chunk, start, layout=lay, patch=pats[i] or None) if pats[i] else request.relocated()[i])
        rep = self.new_report(request)
        rep.compile_forwards = compile_fw
        rep.bytes_canonical = request.page_bytes
        rep.bytes_extra = sum(p.nbytes for ps in pats for p in ps)
        rep.extras["patch_ranks"] = [[(p.rank_k, p.rank_v) for p in ps] for ps in pats]
        return ArmResult(kv=concat_kv(parts), next_position=request.next_position, report=rep)
