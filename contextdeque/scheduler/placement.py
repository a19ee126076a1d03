"""``placement="scheduler"``: the placement scheduler as a window placement policy.

Each time chunks enter the window it searches for the order of residents + entering chunks
that keeps stored patches valid and forms the fewest new ones (exact branch-and-bound up to
``exact_max`` chunks, the insertion heuristic beyond), pricing each candidate as the window's own
plan for it (``cost``: its patch policy decides; residents whose prefix changes do what the policy
says, and what they keep costs the staleness they gain). Admission under a token budget: online (``offline=False``) the oldest residents leave
first, as under arrival order; offline (``offline=True``, knowing the trace through
``PlacementView.future``) the residents the trace never names again leave first, then the
oldest, and a chunk the agent will reorder before it leaves goes where the agent asked (its
reorder decides every prefix then). Every decision is held to the agent's asked order: the search
prices departing from it (the ``diverge`` weight: a later reorder re-forms what stands behind a
departure), and an order that forms more patches now than the asked order is never returned.
"""

from __future__ import annotations

from typing import Sequence

from ..window.placement import Key, PlacementPolicy, PlacementView, let_go
from .cost import DEFAULT_WEIGHTS, Weights
from .search import EXACT_MAX_CHUNKS, schedule


class SchedulerPlacement(PlacementPolicy):
    name = "scheduler"

    def __init__(self, *, exact_max: int = EXACT_MAX_CHUNKS, weights: Weights = DEFAULT_WEIGHTS, offline: bool = False) -> None:
        self.exact_max = int(exact_max)
        self.weights = weights
        self.offline = bool(offline)
        self.decisions = {"exact": 0, "heuristic": 0, "arrival": 0}

    def place(self, view: PlacementView, entering: Sequence[tuple[Key, int | None]]) -> list[Key]:
        if not entering or not view.conditioning:
            # nothing to keep valid (no patches): the agent's order costs nothing more
            order = list(view.order)
            for key, at in entering:
                order.insert(len(order) if at is None else min(int(at), len(order)), key)
            return order
        if not self.offline and view.future is not None:
            view = PlacementView(**{**view.__dict__, "future": None})
        next_op = getattr(view.future, "next_op", None) if self.offline else None
        if next_op is not None and any(next_op(k) == "reorder" for k, _ in entering):
            # offline: the agent reorders the window before this chunk leaves it; the order it asks
            # for then decides every prefix, and a chunk placed off the agent's order only adds forms
            self.decisions["deferred"] = self.decisions.get("deferred", 0) + 1
            order = list(view.order)
            for key, at in entering:
                order.insert(len(order) if at is None else min(int(at), len(order)), key)
            return order
        order, _, how = schedule(view, entering, self.weights, self.exact_max, price=False)
        self.decisions[how] += 1
        return order

    def make_room(self, view: PlacementView, need: int) -> list[Key]:
        if view.budget_tokens is None:
            return []
        used = sum(view.tokens[k] for k in view.order)
        if used + need <= view.budget_tokens:
            return []
        if not (self.offline and view.future is not None):
            # online: the oldest first, as arrival order does. (Sparing the residents something is
            # conditioned on evicts the newest chunks, the ones most likely to be read again: it
            # formed more patches than arrival order on the generated sets.)
            return super().make_room(view, need)
        # offline: the residents the trace never names again go first (oldest first), then the
        # oldest. (Belady's farthest-next-reference first evicted chunks arrival order keeps and
        # whose stored patches a later recall would have hit: it formed more than arrival order
        # on 5 of 72 generated traces under a budget; this rule on 1.)
        dead = [k for k in view.order if view.future.get(k) is None]
        return let_go(view, need, dead + [k for k in view.order if view.future.get(k) is not None])

    def __repr__(self) -> str:
        return f"SchedulerPlacement(exact_max={self.exact_max}, offline={self.offline})"


class OfflineSchedulerPlacement(SchedulerPlacement):
    """The scheduler with the whole trace known (see the module doc)."""

    name = "scheduler-offline"

    def __init__(self, **kw) -> None:
        kw.setdefault("offline", True)
        super().__init__(**kw)
