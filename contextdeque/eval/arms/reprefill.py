"""Re-prefill: the ceiling. One forward over the root and every chunk, nothing reused."""

from __future__ import annotations

from .base import ArmResult, ReuseArm, ReuseRequest


class ReprefillArm(ReuseArm):
    """Full prefill of ``[root, chunk_1 .. chunk_N]`` in one forward (what a cache miss costs)."""

    name = "reprefill"

    def run(self, request: ReuseRequest) -> ArmResult:
        R = request.root_len
        res = request.backend.reprefill(request.chunks)
        rep = self.new_report(request)
        n = R + request.n_chunk_tokens
        rep.forwards = 1
        rep.tokens_prefilled = n
        rep.token_layers = request.n_chunk_tokens * request.num_layers  # the root is counted apart
        rep.tokens_recomputed = request.n_chunk_tokens
        rep.extras["root_tokens_prefilled"] = R
        return ArmResult(kv=[(k.clone(), v.clone()) for k, v in res.kv], next_position=request.next_position, report=rep)
