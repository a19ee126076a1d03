"""EPIC / MPIC: every query recomputes the first ``k`` (32) tokens of each non-leading chunk."""

from .reuse import ReuseCost


class EpicCost(ReuseCost):
    name = "epic"
    k = 32

    def query(self, eng, q_tokens: int, out_tokens: int) -> None:
        super().query(eng, q_tokens, out_tokens)
        self.recompute(eng, sum(min(self.k, eng.tokens[c]) for c in eng.order[1:]))
