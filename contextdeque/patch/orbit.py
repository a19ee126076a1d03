"""Orbit patch: Δ averaged over orderings of the antecedent set, then one SVD.

One patch serves every ordering of the set (reorder is free). Exhaustive over all orderings for
up to ``exhaustive_max`` antecedents (default 4: at most 24 forwards), a seeded sample of
``max_orderings`` orderings above that.
"""

from __future__ import annotations

import itertools
import random

import torch

from .base import FormContext, PatchKind


def orderings(n: int, exhaustive_max: int = 4, max_orderings: int = 24, seed: int = 0) -> list[tuple[int, ...]]:
    """The orderings an orbit patch averages over (identity first)."""
    if n <= exhaustive_max:
        return list(itertools.permutations(range(n)))
    rng = random.Random(seed)
    seen = {tuple(range(n))}
    out = [tuple(range(n))]
    while len(out) < max_orderings:
        p = list(range(n))
        rng.shuffle(p)
        if tuple(p) not in seen:
            seen.add(tuple(p))
            out.append(tuple(p))
    return out


class OrbitPatch(PatchKind):
    name = "orbit"
    ordered = False

    def target(self, ctx: FormContext) -> tuple[torch.Tensor, torch.Tensor]:
        opts = ctx.options
        perms = opts.get("orderings") or orderings(
            len(ctx.antecedents),
            exhaustive_max=int(opts.get("exhaustive_max", 4)),
            max_orderings=int(opts.get("max_orderings", 24)),
            seed=int(opts.get("seed", 0)),
        )
        sum_k = sum_v = None
        for perm in perms:
            keys, values = ctx.conditioned_content(perm)
            dk, dv = ctx.deltas_against(keys, values)
            sum_k = dk if sum_k is None else sum_k + dk
            sum_v = dv if sum_v is None else sum_v + dv
        return sum_k / len(perms), sum_v / len(perms)
