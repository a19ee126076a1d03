"""CacheBlend: every query recomputes the top ``ratio`` (15%) of the non-leading chunks' tokens in
context (selected by KV deviation at a check layer)."""

from .reuse import ReuseCost


class CacheBlendCost(ReuseCost):
    name = "cacheblend"
    ratio = 0.15

    def query(self, eng, q_tokens: int, out_tokens: int) -> None:
        super().query(eng, q_tokens, out_tokens)
        lead = eng.tokens[eng.order[0]] if eng.order else 0
        self.recompute(eng, int(round(self.ratio * (eng.window_tokens - lead))))
