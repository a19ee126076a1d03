"""VLCache: every query recomputes the first ``r_l * T`` tokens per layer of each non-leading
chunk; the default schedule is a linear ramp non-increasing with depth whose mean is ``ratio``
(15%), so 15% of those chunks' token-layers: charged as that many tokens of prefill."""

from .reuse import ReuseCost


class VLCacheCost(ReuseCost):
    name = "vlcache"
    ratio = 0.15

    def query(self, eng, q_tokens: int, out_tokens: int) -> None:
        super().query(eng, q_tokens, out_tokens)
        lead = eng.tokens[eng.order[0]] if eng.order else 0
        self.recompute(eng, int(round(self.ratio * (eng.window_tokens - lead))))
