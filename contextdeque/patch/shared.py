"""Shared-basis patch: a per-layer basis pooled over many chunks; only coefficients are per chunk.

The deficit's directions are a property of the model (the paper, §4): fit a :class:`SharedBasis`
once from a few (chunk, antecedents) pairs, then each patch stores just ``u = Δ · Wᵀ`` (``[T, m]``
per layer), projecting its own Δ onto the shared orthonormal rows ``W``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..core.chunk import digest
from ..core.errors import PatchError
from .base import FormContext, PatchKind, _normalize_antecedents
from .topm import truncated_svd
from .rank import DEFAULT_RANK

if TYPE_CHECKING:  # pragma: no cover
    from ..model.hf import HFBackend
    from ..core.chunk import Chunk


@dataclass
class SharedBasis:
    """Per-layer orthonormal rows: ``k_w [L, m_k, F_k]``, ``v_w [L, m_v, F_v]`` (fp32)."""

    fingerprint: str
    k_w: torch.Tensor
    v_w: torch.Tensor

    @property
    def id(self) -> str:
        return digest(self.fingerprint, self.k_w, self.v_w)[:24]

    @property
    def rank(self) -> int:
        return int(self.k_w.shape[1])

    @classmethod
    def fit(
        cls,
        backend: "HFBackend",
        items: Sequence[tuple["Chunk", Sequence[Any]]],
        rank: int = DEFAULT_RANK,
        rank_v: int | None = None,
    ) -> "SharedBasis":
        """Pool Δ rows of every ``(chunk, antecedents)`` item per layer and keep the top directions."""
        if not items:
            raise PatchError("a shared basis needs at least one (chunk, antecedents) item")
        pooled_k: list[list[torch.Tensor]] = []
        pooled_v: list[list[torch.Tensor]] = []
        for chunk, ants in items:
            ctx = FormContext(backend, chunk, _normalize_antecedents(ants, None, backend), {})
            keys, values = ctx.conditioned_content()
            dk, dv = ctx.deltas_against(keys, values)
            if not pooled_k:
                pooled_k = [[] for _ in range(dk.shape[0])]
                pooled_v = [[] for _ in range(dv.shape[0])]
            for l in range(dk.shape[0]):
                pooled_k[l].append(dk[l])
                pooled_v[l].append(dv[l])
        rv = rank if rank_v is None else rank_v
        # one batched factorization over the layers; its V^T rows are orthonormal: the basis
        k_w = truncated_svd(torch.stack([torch.cat(rows) for rows in pooled_k]), rank)[1]
        v_w = truncated_svd(torch.stack([torch.cat(rows) for rows in pooled_v]), rv)[1]
        return cls(fingerprint=backend.fingerprint, k_w=k_w, v_w=v_w)


class SharedBasisPatch(PatchKind):
    name = "shared"

    def factorize(self, ctx: FormContext, dk, dv, rank_k, rank_v, layers):
        basis: SharedBasis | None = ctx.options.get("basis")
        if basis is None:
            raise PatchError("a shared-basis patch needs basis=SharedBasis.fit(...)")
        if basis.fingerprint != ctx.backend.fingerprint:
            raise PatchError("the shared basis was fitted on another model")
        mk, mv = min(rank_k, basis.k_w.shape[1]), min(rank_v, basis.v_w.shape[1])
        k_w = basis.k_w[list(layers), :mk]
        v_w = basis.v_w[list(layers), :mv]
        k_u = torch.stack([dk[l] @ k_w[i].T for i, l in enumerate(layers)])
        v_u = torch.stack([dv[l] @ v_w[i].T for i, l in enumerate(layers)])
        return k_u, k_w, v_u, v_w, basis.id
