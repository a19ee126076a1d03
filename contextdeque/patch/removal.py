"""Removal patch: for a survivor whose antecedent was evicted.

The survivor's current KV is its canonical plus the patches it carries (``current=[...]``),
conditioned on the old antecedents. The removal patch is the low-rank correction from that to
KV(B | the antecedents that remain), stacked on top of the current patches when applied.
"""

from __future__ import annotations

import torch

from .base import FormContext, PatchKind


class RemovalPatch(PatchKind):
    name = "removal"
    stacked = True

    def target(self, ctx: FormContext) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = ctx.conditioned_content()
        return ctx.deltas_against(keys, values, base=list(ctx.options.get("current", ())))
