"""KV selection arms (MM-ShiftKV, SnapKV, StreamingLLM) at a per-head row budget, in the papers'
prefill-only protocol (``eval/arms/kvselect.py``, base ``reprefill``): every query prefills root +
window + query in one forward, then keeps ``budget`` rows per layer and KV head for decoding. So a
query prefills what re-prefill does; what selection changes is the KV held for decoding (``budget``
rows instead of the window's: ``bytes["device"]`` counts the kept rows). Decode time is charged as
for every arm (the calibration has no per-row decode constant). Named ``<arm>-<rows>``
(``snapkv-256``); the bare name is the default budget."""

from .reuse import ReuseCost


class _SelectCost(ReuseCost):
    canonicals = False
    budgeted = True

    def query(self, eng, q_tokens: int, out_tokens: int) -> None:
        self.recompute(eng, eng.window_tokens)
        eng.r.bytes["device"] += min(eng.window_tokens + q_tokens, int(self.budget)) * eng.kv_bpt


class MMShiftKVCost(_SelectCost):
    name = "mm-shiftkv"


class SnapKVCost(_SelectCost):
    name = "snapkv"


class StreamingLLMCost(_SelectCost):
    name = "streamingllm"
