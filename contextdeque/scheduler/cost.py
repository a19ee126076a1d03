"""The placement cost: what an order of the window costs in patch forms, store hits and staleness.

For a candidate order, every chunk is looked at behind its prefix, as the window's default patch
policy would treat it:

- nothing in front: its canonical is exact (free);
- an *entering* chunk (append / recall): a stored exact (or recall) patch on exactly this
  prefix, or an orbit patch on this prefix's set, is a store hit (``hit``); otherwise one
  conditioned forward forms a patch (``form``). A recall whose new KV differs from the KV it
  left with (another prefix, or no stored patch) changes its version, and every resident
  conditioned on it is re-formed (the conditioning graph's recall cascade, ``form`` each);
- a *resident*: unchanged prefix = still valid (free); a changed prefix is kept as is (the
  default policy keeps survivors and chunks something was inserted before), paying ``stale`` x
  its staleness score (``window.staleness``, token-weighted, 0..1);
- *divergence* from the order the agent asked for (residents as they stand, entering chunks at
  their ``at`` or the end): every position from the first one where the candidate departs from
  it costs ``diverge``. That is what a later ``reorder`` back to the agent's order re-forms at
  most (a chunk whose prefix a reorder leaves untouched keeps its conditioning; one whose prefix
  it changes forms): a deviation that saves one form now at the front of a long window would
  cost many at the agent's next comparison reorder, which an online scheduler cannot see coming.

Weights are in units of one patch form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

from ..window.placement import PlacementView
from ..window.staleness import staleness_score

Key = Hashable


@dataclass(frozen=True)
class Weights:
    form: float = 1.0
    hit: float = 0.02
    stale: float = 1.0
    move: float = 1e-3  # a resident whose prefix changes at all (prefers the least churn on ties)
    # a position behind the first departure from the agent's asked order: the share of them a later
    # reorder is expected to re-form (1.0, the worst case of a reorder straight back, never departs
    # on the generated sets and saves nothing without a budget; 0.5 keeps 215 of 216 generated
    # traces at or below arrival order, and 356 of 360 held-out ones: docs/replay.md)
    diverge: float = 0.5


DEFAULT_WEIGHTS = Weights()


@dataclass
class OrderCost:
    total: float
    forms: int
    hits: int
    stale: float


def asked_order(view: PlacementView, entering: Sequence[tuple[Key, "int | None"]]) -> list[Key]:
    """The order the agent asked for: ``view.order`` with each entering ``(key, at)`` at ``at``
    (None: the end), as arrival order places them."""
    order = list(view.order)
    for key, at in entering:
        order.insert(len(order) if at is None else min(int(at), len(order)), key)
    return order


def entering_cost(view: PlacementView, key: Key, prefix: Sequence[Key], w: Weights) -> tuple[float, bool, bool]:
    """``(cost, formed, version_changed)`` of an entering chunk behind ``prefix``."""
    if not prefix:
        return 0.0, False, bool(view.formed_on.get(key))
    c = view.content[key]
    pc = tuple(view.content[k] for k in prefix)
    if view.has_patch(c, pc):
        return w.hit, False, tuple(prefix) != tuple(view.formed_on.get(key, ()))
    if view.has_orbit(c, frozenset(pc)):
        return w.hit, False, True
    return w.form, True, True


def staleness_of(view: PlacementView, k: Key, prefix: Sequence[Key]) -> float:
    """The staleness score (``window.staleness``) of ``k``'s conditioning behind ``prefix``."""
    f = view.formed_on.get(k, ())
    return staleness_score([(a, view.tokens[a]) for a in f if a in view.tokens], [(a, view.tokens[a]) for a in prefix])


class Scorer:
    """Incremental costing of orders over one view: :meth:`add` extends a partial order by one
    chunk and returns its cost (each chunk's cost depends only on what precedes it), so a search
    prices a node in O(prefix) instead of re-pricing the whole order."""

    def __init__(self, view: PlacementView, entering: frozenset, w: Weights = DEFAULT_WEIGHTS,
                 asked: Sequence[Key] | None = None) -> None:
        self.view, self.entering, self.w = view, entering, w
        # the agent's asked order (None: no divergence term); a position departs from it when the
        # chunk there or anything before it differs
        self.asked = tuple(asked) if asked is not None and w.diverge else None
        self.pos = {k: i for i, k in enumerate(view.order)}
        self._stale_now: dict[Key, float] = {}

    def stale_now(self, k: Key) -> float:
        """The staleness resident ``k`` already has where it stands."""
        if k not in self._stale_now:
            i = self.pos[k]
            self._stale_now[k] = self.staleness(k, self.view.order[:i])
        return self._stale_now[k]

    def staleness(self, k: Key, prefix: Sequence[Key]) -> float:
        return staleness_of(self.view, k, prefix)

    def add(self, prefix: Sequence[Key], k: Key, state: tuple[frozenset, frozenset]) -> tuple[float, int, int, float, tuple[frozenset, frozenset]]:
        """Cost of ``k`` behind ``prefix``; ``state`` = (versions changed, cascade-reformed) so far.
        Returns ``(cost, forms, hits, stale, new state)``."""
        out = self._add(prefix, k, state)
        if self.asked is not None and self.diverged(prefix, k):
            return (out[0] + self.w.diverge,) + out[1:]
        return out

    def diverged(self, prefix: Sequence[Key], k: Key) -> bool:
        """Whether ``prefix + [k]`` departs from the agent's asked order."""
        a, n = self.asked, len(prefix)
        return a is None or n >= len(a) or a[n] != k or tuple(prefix) != a[:n]

    def _add(self, prefix: Sequence[Key], k: Key, state: tuple[frozenset, frozenset]) -> tuple[float, int, int, float, tuple[frozenset, frozenset]]:
        v, w = self.view, self.w
        changed, reformed = state
        if k in self.entering:
            c, formed, vchanged = entering_cost(v, k, prefix, w)
            forms, hits = int(formed), int((not formed) and bool(prefix))
            if vchanged:
                changed = changed | {k}
                new = [d for d in v.dependents(k) if d not in reformed and d not in self.entering]
                if new:
                    reformed = reformed | set(new)
                    c += w.form * len(new)
                    forms += len(new)
            return c, forms, hits, 0.0, (changed, reformed)
        if k in reformed:
            return 0.0, 0, 0, 0.0, state
        f = v.formed_on.get(k, ())
        n = len(prefix)
        if n == len(f) and tuple(prefix) == tuple(f) and (not changed or not any(a in changed for a in f)):
            return 0.0, 0, 0, 0.0, state
        i = self.pos.get(k)
        if i == n and tuple(prefix) == tuple(v.order[:i]) and (not changed or not any(a in changed for a in prefix)):
            return 0.0, 0, 0, 0.0, state  # where it stood, behind the same chunks: nothing new
        s = max(0.0, self.staleness(k, prefix) - (self.stale_now(k) if i is not None else 0.0))
        action, c = upkeep(v, k, prefix, s, w)
        if action == "keep":
            return c, 0, 0, s, state
        return c, int(action in ("refresh", "removal")), int(action == "refresh-hit"), 0.0, state


UPKEEP_ACTIONS = ("keep", "clear", "refresh-hit", "removal", "refresh")


def is_subsequence(short: Sequence[Key], long: Sequence[Key]) -> bool:
    """Whether ``short`` is ``long`` with some items left out (order kept)."""
    it = iter(long)
    return all(any(x == y for y in it) for x in short)


def upkeep(view: PlacementView, key: Key, prefix: Sequence[Key], gained: float, w: Weights = DEFAULT_WEIGHTS) -> tuple[str, float]:
    """What a resident whose prefix changed should do with its conditioning, and its cost.

    ``gained``: the staleness it would gain by keeping its patch. The choices (DESIGN §4, the
    safety envelope's staleness score deciding): ``keep`` (``stale x gained``); ``clear`` (at the
    front the canonical is exact: free); ``refresh-hit`` (the store holds an exact patch of its
    content on exactly this prefix: a hit); ``removal`` (only departures from the antecedents it
    was formed on: a removal patch, one conditioned forward) or ``refresh`` (a new exact patch,
    one conditioned forward). A move costs ``w.move`` on top whatever is chosen; ties keep.
    """
    keep = w.stale * gained + w.move
    if not prefix:
        return ("clear", w.move) if view.formed_on.get(key) else ("keep", keep)
    if view.any_stored(view.content[key]) and view.has_patch(view.content[key], tuple(view.content[a] for a in prefix)):
        if w.hit + w.move < keep:
            return "refresh-hit", w.hit + w.move
    if w.form + w.move < keep:
        return ("removal" if is_subsequence(prefix, view.formed_on.get(key, ())) else "refresh"), w.form + w.move
    return "keep", keep


def order_cost(view: PlacementView, order: Sequence[Key], entering: frozenset, w: Weights = DEFAULT_WEIGHTS,
               asked: Sequence[Key] | None = None) -> OrderCost:
    """The cost of ``order`` (residents + ``entering`` keys): forms and hits of the entering
    chunks, cascade re-forms, the staleness residents gain (beyond what they already had), and
    its divergence from ``asked`` (the agent's order, :func:`asked_order`; None: not priced)."""
    sc = Scorer(view, entering, w, asked)
    total, forms, hits, stale = 0.0, 0, 0, 0.0
    state: tuple[frozenset, frozenset] = (frozenset(), frozenset())
    for i, k in enumerate(order):
        c, f, h, s, state = sc.add(order[:i], k, state)
        total += c
        forms += f
        hits += h
        stale += s
    return OrderCost(total, forms, hits, stale)
