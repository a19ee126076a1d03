"""KVCapsule (linear): every canonical stored compressed at rest (the kept fraction of its bytes,
``core.capsule.DEFAULT_RETENTION``: the paper's ~60% compression), reconstructed and relocated on
entry (no forward), and given the same conditioning patches as the patch arm. The pool therefore
holds ~2.5x as many canonicals in the same bytes; a read also pays the reconstruction (one more
write of the page)."""

from ..core.capsule import DEFAULT_RETENTION
from .reuse_patch import PatchCost


class KVCapsuleCost(PatchCost):
    name = "kvcapsule-linear"
    retention = DEFAULT_RETENTION
    window_policy = None  # the patch arm's window over a compressed-at-rest store: not driven live

    def canonical_bytes(self, tokens: int, kv_bytes_per_token: int) -> int:
        return max(1, int(round(tokens * kv_bytes_per_token * self.retention)))

    def query(self, eng, q_tokens: int, out_tokens: int) -> None:
        super().query(eng, q_tokens, out_tokens)
        eng.charge_apply(eng.window_tokens)  # reconstruction: the page written once more
