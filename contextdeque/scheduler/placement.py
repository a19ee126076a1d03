"""``placement="scheduler"``: the placement scheduler as a window placement policy.

Each time chunks enter the window it searches for the order of residents + entering chunks
that keeps stored patches valid and forms the fewest new ones (exact branch-and-bound up to
``exact_max`` chunks, the insertion heuristic beyond). Admission under a token budget: online
(``offline=False``) it lets go first of the oldest residents nothing is conditioned on (their
departure invalidates no stored patch); offline (``offline=True``, knowing the trace through
``PlacementView.future``) the resident the trace names farthest in the future leaves first
(Belady's rule applied to admission).
"""

from __future__ import annotations

from typing import Sequence

from ..window.placement import Key, PlacementPolicy, PlacementView
from .cost import DEFAULT_WEIGHTS, Weights
from .search import EXACT_MAX_CHUNKS, schedule


class SchedulerPlacement(PlacementPolicy):
    name = "scheduler"

    def __init__(self, *, exact_max: int = EXACT_MAX_CHUNKS, weights: Weights = DEFAULT_WEIGHTS, offline: bool = False) -> None:
        self.exact_max = int(exact_max)
        self.weights = weights
        self.offline = bool(offline)
        self.decisions = {"exact": 0, "heuristic": 0}

    def place(self, view: PlacementView, entering: Sequence[tuple[Key, int | None]]) -> list[Key]:
        if not entering or not view.conditioning:
            # nothing to keep valid (no patches): the agent's order costs nothing more
            order = list(view.order)
            for key, at in entering:
                order.insert(len(order) if at is None else min(int(at), len(order)), key)
            return order
        if not self.offline and view.future is not None:
            view = PlacementView(**{**view.__dict__, "future": None})
        order, _, how = schedule(view, entering, self.weights, self.exact_max, price=False)
        self.decisions[how] += 1
        return order

    def make_room(self, view: PlacementView, need: int) -> list[Key]:
        if view.budget_tokens is None:
            return []
        used = sum(view.tokens[k] for k in view.order)
        if used + need <= view.budget_tokens:
            return []
        age = {k: i for i, k in enumerate(view.order)}
        if self.offline and view.future is not None:
            far = float("inf")
            rank = sorted(view.order, key=lambda k: (-(view.future.get(k) if view.future.get(k) is not None else far), age[k]))
        else:
            rank = sorted(view.order, key=lambda k: (len(view.dependents(k)) > 0, age[k]))
        out: list[Key] = []
        for k in rank:
            if used + need <= view.budget_tokens:
                break
            out.append(k)
            used -= view.tokens[k]
        return out

    def __repr__(self) -> str:
        return f"SchedulerPlacement(exact_max={self.exact_max}, offline={self.offline})"


class OfflineSchedulerPlacement(SchedulerPlacement):
    """The scheduler with the whole trace known (see the module doc)."""

    name = "scheduler-offline"

    def __init__(self, **kw) -> None:
        kw.setdefault("offline", True)
        super().__init__(**kw)
