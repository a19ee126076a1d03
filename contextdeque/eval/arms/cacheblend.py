"""CacheBlend: recompute the top-r% tokens ranked by KV deviation at a check layer, in context.

Deviation of token t: ``||K_l[t] - K̂_l[t]||² + ||V_l[t] - V̂_l[t]||²`` at the check layer ``l``
between a partial in-context prefill (layers ``0..l`` of every chunk token after the root) and the
blindly reused KV. Layer 0's KV depends on the token and its position only, so its deviation is
zero after exact relocation: the first informative check layer is 1 (the default). The selected
tokens are then re-prefilled in context (see :mod:`.recompute`) and their KV replaced at every layer.
"""

from __future__ import annotations

import torch

from ...core.errors import ReuseArmError
from .base import ArmResult, ReuseArm, ReuseRequest
from .recompute import check_layer_kv, recompute_in_context


class CacheBlendArm(ReuseArm):
    """``ratio`` of all chunk tokens (or an absolute ``budget`` of tokens) chosen by deviation at
    ``check_layer``, recomputed in context."""

    name = "cacheblend"

    def __init__(
        self, ratio: float = 0.15, *, budget: int | None = None, check_layer: int = 1, label: str | None = None
    ) -> None:
        if not 0.0 <= float(ratio) <= 1.0:
            raise ReuseArmError(f"cacheblend ratio must be in [0, 1], got {ratio}")
        if budget is not None and int(budget) < 0:
            raise ReuseArmError(f"cacheblend budget must be >= 0 tokens, got {budget}")
        super().__init__(label=label or (f"cacheblend-{round(100 * ratio)}" if budget is None else f"cacheblend-{budget}tok"))
        self.ratio, self.budget, self.check_layer = float(ratio), budget, int(check_layer)

    def n_select(self, request: ReuseRequest) -> int:
        N = request.n_chunk_tokens
        n = int(self.budget) if self.budget is not None else int(round(self.ratio * N))
        return max(0, min(N, n))

    def deviation(self, request: ReuseRequest) -> torch.Tensor:
        """``[N]`` per-token KV deviation at the check layer (costs a partial forward)."""
        k_chk, v_chk = check_layer_kv(request, self.check_layer)
        k_re, v_re = request.blind_kv()[self.check_layer]
        R = request.root_len
        dk = (k_chk.float() - k_re[:, R:].float()).pow(2).sum(dim=(0, 2))
        dv = (v_chk.float() - v_re[:, R:].float()).pow(2).sum(dim=(0, 2))
        return dk + dv

    def run(self, request: ReuseRequest) -> ArmResult:
        rep = self.new_report(request)
        rep.bytes_canonical = request.page_bytes
        base = request.blind_kv()
        N, n = request.n_chunk_tokens, self.n_select(request)
        if n == 0:
            return ArmResult(kv=base, next_position=request.next_position, report=rep)
        if n < N:
            dev = self.deviation(request)
            sel = torch.topk(dev, n, largest=True, sorted=True).indices
            rep.forwards += 1
            rep.tokens_prefilled += N
            rep.token_layers += N * (self.check_layer + 1)
        else:
            sel = torch.arange(N)  # everything is selected: nothing to rank
        kv, st = recompute_in_context(request, base, sel)
        rep.forwards += 1
        rep.tokens_prefilled += st.tokens
        rep.token_layers += st.token_layers
        rep.tokens_recomputed = st.replaced
        rep.extras["selected"] = n
        return ArmResult(kv=kv, next_position=request.next_position, report=rep)
