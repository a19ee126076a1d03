"""The exact patch policy: the window always equals a re-prefill of its contents.

Every slot whose conditioning was not formed on exactly its current prefix (same chunks, same
states, same order) gets a full-rank patch on that prefix: an exact (or, for a recalled chunk,
recall) patch, or — for a survivor of a slide or mid-window eviction — a full-rank removal
patch stacked on what it carries. Full rank reconstructs the conditioned KV to float rounding,
so ``materialize()`` equals the KV of one forward over ``root + chunks``. It costs one
conditioned forward per affected slot: this is the fidelity ceiling, not the cheap path.
"""

from __future__ import annotations

from typing import Sequence

from ..patch.rank import FULL
from .policy import CLEAR, KEEP, Decision, PatchPolicy, form
from .slot import Slot


class ExactPolicy(PatchPolicy):
    name = "exact"
    regime = "exact"

    def __init__(self, *, max_stack: int = 4) -> None:
        # A survivor stacks one removal patch per slide it survives; past max_stack patches
        # one fresh exact patch replaces the stack (same KV, fewer factors to apply).
        self.max_stack = int(max_stack)

    def decide(self, reason: str | None, slot: Slot, prefix: Sequence[Slot], *, valid: bool, rank: int) -> Decision:
        if valid:
            return KEEP
        if not prefix:
            return CLEAR  # nothing in front: the canonical is KV(B | root) exactly
        if reason == "survivor" and slot.stack and len(slot.stack) < self.max_stack:
            return form("removal", FULL, stack=True)
        return form("recall" if reason == "recall" else "exact", FULL)

    def __repr__(self) -> str:
        return f"ExactPolicy(max_stack={self.max_stack})"
