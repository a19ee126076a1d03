"""``placement="valid"`` (and ``recall_placement``'s default): the placement scheduler for chunks the
agent did not pin (``recall(ref)`` with no ``at``).

The same search and cost as ``placement="scheduler"`` with no price on departing from the end
(``diverge=0``): the agent said any place will do, so nothing it asked can be re-formed by a later
reorder back to it. The search then takes the place where the fewest patches are formed and the
residents gain the least staleness: behind the chunks the entering chunk's stored patch was formed
on (its patch, and the chunks conditioned on it, valid again), the front (its canonical is exact
there, and the chunks that were conditioned on it while it stood there are valid again), or the
end. Never an order that forms more patches now than the end would (the scheduler's hard rule).
"""

from __future__ import annotations

from dataclasses import replace

from .cost import DEFAULT_WEIGHTS, Weights
from .placement import SchedulerPlacement


class ValidPlacement(SchedulerPlacement):
    name = "valid"

    def __init__(self, *, weights: Weights = replace(DEFAULT_WEIGHTS, diverge=0.0), **kw) -> None:
        super().__init__(weights=weights, **kw)

    def __repr__(self) -> str:
        return f"ValidPlacement(exact_max={self.exact_max})"
