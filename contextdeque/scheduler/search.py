"""Searching for the cheapest order: exact branch-and-bound (small windows), brute force (the
test oracle), and the insertion heuristic (any size).

Exact: a depth-first search over orders that keep the residents' relative order (a live window
honours only where an entering chunk goes; moving residents among themselves also departs from
the agent's order, which a later reorder makes expensive), extending a prefix one chunk at a time;
every chunk's cost depends only on what precedes it, so a partial order's cost never decreases as
it grows and a branch whose partial cost reaches the best complete order's is cut. Children are
tried cheapest first (and the heuristic's answer seeds the bound), so most branches die early. The
result equals the brute-force minimum over all such orders (tested).

Heuristic: residents keep their relative order (moving them only makes them stale); each
entering chunk, in arrival order, goes to the cheapest of a few candidate slots: where the agent
asked (or the end), and right after every window prefix on which the store holds a patch of its
content (from the patch graph) — the only places where it can land without a forward.
"""

from __future__ import annotations

import itertools
from typing import Hashable, Sequence

from ..window.placement import PlacementView
from .cost import DEFAULT_WEIGHTS, Scorer, Weights, asked_order, order_cost

Key = Hashable
EXACT_MAX_CHUNKS = 8


def brute_force(view: PlacementView, entering: Sequence[tuple[Key, int | None]], w: Weights = DEFAULT_WEIGHTS) -> tuple[list[Key], float]:
    """The minimum over every permutation that keeps the residents' relative order (the oracle;
    factorial time)."""
    keys = list(view.order) + [k for k, _ in entering]
    ent = frozenset(k for k, _ in entering)
    asked = asked_order(view, entering)
    best, best_cost = None, float("inf")
    for perm in itertools.permutations(keys):
        if not _residents_in_order(view, perm):
            continue
        c = order_cost(view, perm, ent, w, asked).total
        if c < best_cost - 1e-12:
            best, best_cost = list(perm), c
    return best or [], best_cost


def _residents_in_order(view: PlacementView, order: Sequence[Key]) -> bool:
    """Whether ``order`` keeps the residents' relative order (what a live window honours)."""
    res = set(view.order)
    return [k for k in order if k in res] == list(view.order)


def exact(view: PlacementView, entering: Sequence[tuple[Key, int | None]], w: Weights = DEFAULT_WEIGHTS,
          seed: Sequence[Key] | None = None) -> tuple[list[Key], float]:
    """Branch-and-bound minimum over every order of residents (kept in their relative order) +
    entering chunks.

    Lower bound on what the chunks still to place will cost: one form for every entering chunk
    with no stored patch of its content at all and one hit for every other entering chunk (only
    the chunk at the very front is free), plus, once something is placed, for every resident still
    to place that carries no conditioning and stands at the front now, the cheaper of a full
    staleness (behind any chunk its canonical is blind) and its refresh (a hit where the store
    holds any patch of its content, else a form), unless the recall cascade re-forms it; a form
    at the chunk's fastest (``Weights.floor_s``: behind any context).
    """
    keys = list(view.order) + [k for k, _ in entering]
    ent = frozenset(k for k, _ in entering)
    asked = asked_order(view, entering)
    if seed is None:
        seed, _ = heuristic(view, entering, w, price=False)
    best = [list(seed), order_cost(view, seed, ent, w, asked).total]
    sc = Scorer(view, ent, w, asked)
    # (a form or hit costs at least the chunk's fastest form, or that share of it; staleness and
    # moves are priced in the decision's typical form, unit)
    unit = sc.unit_s()
    floor = {k: (1.0 if not view.any_stored(view.content[k]) else w.hit) * w.floor_s(view.tokens[k]) for k in ent}
    blind_front = {k: min(w.stale * (1.0 - sc.stale_now(k)) * unit,
                          (w.hit if view.any_stored(view.content[k]) else 1.0) * w.floor_s(view.tokens[k])) + w.move * unit
                   for k in view.order if not view.formed_on.get(k) and sc.stale_now(k) < 1.0}
    # an entering chunk whose conditioning was formed on a chunk that is not in this window can
    # never come back with the KV it left with: its recall cascade (re-forming the residents
    # conditioned on it) is certain
    in_window = set(keys)
    cascade = {k: [d for d in view.dependents(k) if d not in ent] for k in ent
               if any(a not in in_window for a in view.formed_on.get(k, ()))}

    def bound(rest: Sequence[Key], prefix_empty: bool, reformed: frozenset) -> float:
        # the cascades still to come re-form at least the largest of their sets (not yet re-formed)
        casc = max((sum(sc.cascade_s(d) for d in cascade[k] if d not in reformed) for k in rest if k in cascade), default=0.0)
        if prefix_empty:  # any one chunk may take the front for free
            lows = [floor[k] if k in floor else blind_front.get(k, 0.0) for k in rest]
            return casc + (sum(lows) - max(lows) if lows else 0.0)
        return casc + sum(floor.get(k, 0.0) for k in rest) + sum(blind_front[k] for k in rest if k in blind_front and k not in reformed)

    def dfs(order: list[Key], rest: list[Key], cost: float, state) -> None:
        if cost + bound(rest, not order, state[1]) >= best[1] - 1e-12:
            return
        if not rest:
            best[0], best[1] = list(order), cost
            return
        children = []
        first_resident = next((k for k in rest if k not in ent), None)
        for i, k in enumerate(rest):
            if k not in ent and k != first_resident:
                continue  # residents keep their relative order
            c, _, _, _, st = sc.add(order, k, state)
            children.append((cost + c, i, k, st))
        children.sort(key=lambda x: (x[0], x[1]))
        for c, i, k, st in children:
            order.append(k)
            dfs(order, rest[:i] + rest[i + 1 :], c, st)
            order.pop()

    if keys:
        dfs([], keys, 0.0, (frozenset(), frozenset()))
    return best[0], best[1]


def heuristic(view: PlacementView, entering: Sequence[tuple[Key, int | None]], w: Weights = DEFAULT_WEIGHTS,
              *, price: bool = True) -> tuple[list[Key], float]:
    """Greedy insertion at candidate slots (see the module doc). Only the inserted chunk and the
    residents behind it change cost, so each candidate is priced from its slot on, and pricing
    stops as soon as it cannot beat the best slot so far. ``price=False`` skips pricing the final
    order whole (its cost is then NaN): a caller that only wants the order saves O(n^2)."""
    order = list(view.order)
    ent = frozenset(k for k, _ in entering)
    agent = asked_order(view, entering)
    sc = Scorer(view, ent, w, agent)
    placed: list[Key] = []
    for key, at in entering:
        asked = len(order) if at is None else min(int(at), len(order))
        cands = {asked, len(order)}
        stored = set(view.stored_prefixes(view.content[key]))
        if stored:
            pc: list[str] = []
            if () in stored:
                cands.add(0)
            for i, k in enumerate(order):
                pc.append(view.content[k])
                if tuple(pc) in stored:
                    cands.add(i + 1)
        best, best_cost = asked, float("inf")
        if len(cands) == 1:  # one slot (the end, nothing stored to aim for): nothing to compare
            order.insert(asked, key)
            placed.append(key)
            continue
        for pos in sorted(cands, key=lambda p: (p != asked, -p)):
            trial = order[:pos] + [key] + order[pos:]
            state = (frozenset(placed), frozenset())
            cost = 0.0
            for i in range(pos, len(trial)):
                c, _, _, _, state = sc.add(trial[:i], trial[i], state)
                cost += c
                if cost >= best_cost - 1e-12:
                    break
            if cost < best_cost - 1e-12:
                best, best_cost = pos, cost
        order.insert(best, key)
        placed.append(key)
    return order, (order_cost(view, order, ent, w, agent).total if price else float("nan"))


def schedule(view: PlacementView, entering: Sequence[tuple[Key, int | None]], w: Weights = DEFAULT_WEIGHTS,
             exact_max: int = EXACT_MAX_CHUNKS, *, price: bool = True) -> tuple[list[Key], float, str]:
    """The scheduler's order: exact for windows of at most ``exact_max`` chunks, else the heuristic.
    Returns ``(order, cost, "exact" | "heuristic")`` (``price=False``: the heuristic's cost is NaN)."""
    n = len(view.order) + len(entering)
    if n <= exact_max:
        h, _ = heuristic(view, entering, w, price=False)
        o, c = exact(view, entering, w, seed=h)
        how = "exact"
    else:
        o, c = heuristic(view, entering, w, price=price)
        how = "heuristic"
    return _no_more_forms(view, entering, w, o, c, how)


def _no_more_forms(view: PlacementView, entering: Sequence[tuple[Key, int | None]], w: Weights,
                   order: list[Key], cost: float, how: str) -> tuple[list[Key], float, str]:
    """The hard constraint: an order that forms more patches now than the agent's asked order
    (arrival placement) is never returned, whatever staleness it would save: the asked order is."""
    asked = asked_order(view, entering)
    if order == asked:
        return order, cost, how
    ent = frozenset(k for k, _ in entering)
    mine, theirs = order_cost(view, order, ent, w, asked), order_cost(view, asked, ent, w, asked)
    if mine.forms > theirs.forms:
        return asked, theirs.total, "arrival"
    return order, cost, how
