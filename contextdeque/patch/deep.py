"""Deep-only patch: factors for the deepest layers only (the deficit grows with depth).

``deep_layers``: how many of the deepest layers carry factors (default: half, rounded up).
"""

from __future__ import annotations

import math

from .base import FormContext, PatchKind


class DeepOnlyPatch(PatchKind):
    name = "deep"

    def layers(self, ctx: FormContext) -> tuple[int, ...]:
        L = ctx.chunk.num_layers
        budget = ctx.options.get("deep_layers")
        n = math.ceil(L / 2) if budget is None else int(budget)
        n = max(0, min(L, n))
        return tuple(range(L - n, L))
