"""Patch: relocate every chunk and add its rank-m conditioning patch (zero serve-time forwards).

The leading chunk has no antecedent (``KV(B|root)`` is already exact) and carries no patch; chunk
``i`` carries a patch of kind ``kind`` formed on chunks ``0..i-1`` (with their own patches when
``chain``, as a window would hold them). Patches handed in with the request are used instead —
truncated to this arm's rank when they are of higher rank (an SVD truncated is the top-m SVD).
"""

from __future__ import annotations

from typing import Any

from ...core.operator import relocate
from ...patch import FidelityRule, Patch, fidelity_report, form_patch
from ...patch.ops import truncate_patch
from .base import ArmResult, ReuseArm, ReuseRequest
from ...core.kv import concat_kv
from ...patch.rank import DEFAULT_RANK


class PatchArm(ReuseArm):
    """Blind relocation plus a rank-``rank`` conditioning patch on every non-leading chunk.

    ``rank``: K rank (``"full"`` = exact Δ); ``rank_v``: V rank (default ``rank``); ``kind``: a
    patch kind (exact, orbit, recall, deep, shared, removal); ``chain``: form each patch with the
    antecedents' own patches applied; ``fidelity``: a :class:`~contextdeque.patch.alloc.FidelityRule`
    (per-layer ranks allocated to its target within its byte cap, at most ``rank``); other keyword
    options go to :func:`form_patch`.
    """

    name = "patch"

    def __init__(
        self,
        rank: int | str = DEFAULT_RANK,
        *,
        rank_v: int | str | None = None,
        kind: str = "exact",
        chain: bool = True,
        label: str | None = None,
        fidelity: FidelityRule | None = None,
        **kind_options: Any,
    ) -> None:
        super().__init__(label=label or f"patch-r{rank}")
        self.rank, self.rank_v, self.kind, self.chain = rank, rank_v, kind, chain
        self.fidelity = fidelity
        self.kind_options = kind_options

    def patches(self, request: ReuseRequest) -> tuple[list[list[Patch]], int]:
        """The patches applied to every chunk and the conditioned forwards spent forming them."""
        be = request.backend
        before = be.forwards_run
        out: list[list[Patch]] = []
        for i, chunk in enumerate(request.chunks):
            given = request.patches_for(i)
            if given:
                cut = [truncate_patch(p, self.rank, self.rank_v) for p in given]
                out.append(cut if self.fidelity is None else [self.fidelity.shape(p, chunk) for p in cut])
            elif i == 0:
                out.append([])
            else:
                ants = [(request.chunks[j], out[j] if self.chain else None) for j in range(i)]
                out.append([form_patch(be, chunk, ants, rank=self.rank, kind=self.kind, rank_v=self.rank_v,
                                       fidelity=self.fidelity, **self.kind_options)])
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
        # directions kept over all layers (K, V) and, under a fidelity rule, what it decided
        rep.extras["patch_directions"] = [[tuple(sum(r) for r in p.layer_ranks) for p in ps] for ps in pats]
        if self.fidelity is not None:
            rep.extras["fidelity"] = [fidelity_report(p) for ps in pats for p in ps]
        return ArmResult(kv=concat_kv(parts), next_position=request.next_position, report=rep)
