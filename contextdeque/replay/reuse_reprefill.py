"""Re-prefill: every query prefills the whole window (no cache at all)."""

from .reuse import ReuseCost


class ReprefillCost(ReuseCost):
    name = "reprefill"
    canonicals = False

    def query(self, eng, q_tokens: int, out_tokens: int) -> None:
        self.recompute(eng, eng.window_tokens)
