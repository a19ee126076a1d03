"""Prefix cache (vLLM / SGLang style): KV of each chunk *at its position after its exact prefix*,
keyed by the chain of content hashes up to it and kept in the device pool under the eviction
policy; a query reuses the leading run of cached entries and prefills everything after the first
miss (then caches it)."""

from ..window.plan import Forward
from .reuse import ReuseCost


class PrefixCacheCost(ReuseCost):
    name = "prefix_cache"
    canonicals = False

    def query(self, eng, q_tokens: int, out_tokens: int) -> None:
        chain = 0
        hit_tokens, miss_tokens, leading = 0, 0, True
        for key in eng.order:
            content = eng.content[key]
            chain = hash((chain, content))
            n = eng.tokens[key]
            where = eng.pool.access(("pfx", chain), n * eng.kv_bpt)
            if leading and where is not None:
                hit_tokens += n
            else:
                leading = False
                miss_tokens += n
        eng.charge_apply(hit_tokens)
        if miss_tokens:
            eng.do(Forward("prefix", miss_tokens, context=hit_tokens), window_op=False)
