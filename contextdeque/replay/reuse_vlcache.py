"""VLCache: every query recomputes the first ``r_l * T`` tokens per layer of each non-leading
chunk; the default schedule is a linear ramp non-increasing with depth whose mean is ``ratio``
(15%), so 15% of those chunks' token-layers: charged as that many tokens of prefill, which is
CacheBlend's charge (the same share of the non-leading chunks' tokens, one partial forward)."""

from .reuse_cacheblend import CacheBlendCost


class VLCacheCost(CacheBlendCost):
    name = "vlcache"
