"""Blind reuse: every chunk's canonical relocated exactly to its position, nothing else."""

from __future__ import annotations

from .base import ArmResult, ReuseArm, ReuseRequest


class BlindArm(ReuseArm):
    """Relocation only (zero forwards): loses each chunk's cross-chunk conditioning."""

    name = "blind"

    def run(self, request: ReuseRequest) -> ArmResult:
        rep = self.new_report(request)
        rep.bytes_canonical = request.page_bytes
        # the request's shared blind KV (read-only by convention, like every ArmResult)
        return ArmResult(kv=list(request.blind_kv()), next_position=request.next_position, report=rep)
