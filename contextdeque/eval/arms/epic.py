"""EPIC / MPIC: recompute the first k tokens of every reused chunk, in context (MPIC-k, k = 32).

The rule targets attention sinks: a chunk encoded on its own makes its first tokens absorb
attention; recomputing them in context tells them they no longer start the sequence. ``k`` may be
one number for every chunk or one per chunk (a matched budget).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...core.errors import ReuseArmError
from .base import ArmResult, ReuseArm, ReuseRequest
from .recompute import recompute_in_context


class EpicArm(ReuseArm):
    """First ``k`` tokens (or ``k[i]`` for chunk ``i``) of each chunk recomputed in context."""

    name = "epic"

    def __init__(self, k: int | Sequence[int] = 32, *, label: str | None = None) -> None:
        ks = [k] if isinstance(k, int) else list(k)
        if any(int(x) < 0 for x in ks):
            raise ReuseArmError(f"epic k must be >= 0, got {k}")
        super().__init__(label=label or (f"epic-{k}" if isinstance(k, int) else "epic-custom"))
        self.k = k

    def per_chunk(self, request: ReuseRequest) -> list[int]:
        if isinstance(self.k, int):
            ks = [self.k] * len(request.chunks)
        else:
            ks = [int(x) for x in self.k]
            if len(ks) != len(request.chunks):
                raise ReuseArmError(f"epic got {len(ks)} per-chunk budgets for {len(request.chunks)} chunks")
        return [min(int(x), c.n_tokens) for x, c in zip(ks, request.chunks)]

    def select(self, request: ReuseRequest) -> torch.Tensor:
        """Chunk-token indices (into ``0..N-1``) this arm recomputes."""
        offs = [o - request.root_len for o in request.offsets]
        parts = [torch.arange(o, o + k) for o, k in zip(offs, self.per_chunk(request))]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def run(self, request: ReuseRequest) -> ArmResult:
        rep = self.new_report(request)
        rep.bytes_canonical = request.page_bytes
        sel = self.select(request)
        kv, st = recompute_in_context(request, request.blind_kv(), sel)
        if st.tokens:
            rep.forwards = 1
        rep.tokens_prefilled = st.tokens
        rep.token_layers = st.token_layers
        rep.tokens_recomputed = st.replaced
        return ArmResult(kv=kv, next_position=request.next_position, report=rep)
