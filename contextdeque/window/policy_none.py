"""The blind policy: no conditioning patches at all (canonical + exact relocation only).

The floor every patch is measured against: single-hop readout survives it (attention over the
chunks merges exactly), cross-chunk binding does not.
"""

from __future__ import annotations

from typing import Sequence

from .policy import KEEP, Decision, PatchPolicy
from .slot import Slot


class NonePolicy(PatchPolicy):
    name = "none"
    conditions = False

    def decide(self, reason: str | None, slot: Slot, prefix: Sequence[Slot], *, valid: bool, rank: int) -> Decision:
        return KEEP
