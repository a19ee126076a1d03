"""The placement objective: the window's own plan for a candidate order, priced.

For a candidate order, every chunk is looked at behind its prefix and the window's patch policy
(``PlacementView.patch_policy``, the one ``reconcile`` runs) decides what happens to it, over key-only
slots (``window.plan.KeySlot``) -- no rule of the policy is restated here:

- an *entering* chunk (append / recall) is decided with its reason; a ``form`` is a store hit
  (``Reuse``) where the store holds its patch on exactly this prefix (``view.has_patch``), else a
  formed patch (``Form``); nothing in front: its canonical. A recall whose new KV differs from
  the KV it left with changes its version, and every resident conditioned on it is re-formed
  (the recall cascade: the policy's ``cascade`` decision, a ``Form`` each; only its direct part);
- a *resident* whose prefix changed is decided as ``"inserted"`` (the default policy: a stored
  patch on its new prefix, else it keeps its conditioning; at the front, its canonical); one that
  keeps pays ``stale`` x the staleness it gains (``window.staleness``, token-weighted, 0..1);
- *divergence* from the order the agent asked for (residents as they stand, entering chunks at
  their ``at`` or the end): every position from the first one where the candidate departs from
  it costs ``diverge``. That is what a later ``reorder`` back to the agent's order re-forms at
  most (a chunk whose prefix a reorder leaves untouched keeps its conditioning; one whose prefix
  it changes forms): a deviation that saves one form now at the front of a long window would
  cost many at the agent's next comparison reorder, which an online scheduler cannot see coming.

The plan's operations are counted by ``Op.counts`` (the counts the window's receipts and the
replay add up) and priced in seconds by the replay's own price list, the cost model
(``CostModel.seconds``, ``scheduler/cost_model.py``): a formed patch costs its conditioned forward
behind its prefix and its factorization. What the cost model does not charge is priced as a share
of the seconds of one form of the chunk it concerns (:class:`Weights`): staleness gained, a move,
a departure from the asked order, and a store hit (a tie-breaker: the replay charges none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

from ..patch.rank import DEFAULT_RANK
from .cost_model import DEFAULTS, CostModel
from ..window.placement import PlacementView
from ..window.plan import ChunkKeys, Clear, Form, Keep, KeySlot, KeySlots, Op, Reuse
from ..window.policy import Decision, PatchPolicy, make_policy
from ..window.staleness import staleness_score

Key = Hashable


@dataclass(frozen=True)
class Weights:
    """What the scheduler charges, in one unit: ``cost`` (a :class:`~.cost_model.CostModel`, the
    replay's price list) prices in seconds; without one (the default) the unit is one patch form,
    whatever its size. A planned operation: a formed patch one form (its conditioned forward
    behind its prefix and its factorization: ``cost.seconds``), a patch reused ``hit`` x its form
    (a tie-breaker: the replay charges a store hit nothing). What the replay does not charge is
    priced in shares of the decision's typical form (``Scorer.unit_s``; one form of a chunk of its
    mean size): ``stale`` per unit of staleness a resident gains, ``move`` for a resident whose
    prefix changes at all (prefers the least churn on ties), ``diverge`` per position behind the
    first departure from the agent's asked order."""

    cost: CostModel | None = field(default=None, repr=False)
    hit: float = 0.02
    stale: float = 1.0
    move: float = 1e-3
    # a position behind the first departure from the agent's asked order: the share of them a later
    # reorder is expected to re-form (1.0, the worst case of a reorder straight back, never departs
    # on the generated sets and saves nothing without a budget; 0.5 kept 215 of 216 generated
    # traces at or below arrival order, and 356 of 360 held-out ones: docs/replay.md, measured
    # before the objective became the window's own plan; tests/test_scheduler.py has today's).
    # In seconds (SECONDS_WEIGHTS) 0.35: replay-bench's rows (4 traces per kind, no budget) at or
    # below their estimated seconds under the forms pricing in every kind (0.5: video 1.9 s above)
    diverge: float = 0.5

    def refresh_s(self, tokens: int, context: int) -> float:
        """One form of a ``tokens``-token chunk behind ``context`` tokens (seconds, or 1 form)."""
        return self.cost.form_s(tokens, context) if self.cost is not None else 1.0

    def floor_s(self, tokens: int) -> float:
        """A lower bound of :meth:`refresh_s` behind any context (the exact search's bound)."""
        return self.cost.form_floor_s(tokens) if self.cost is not None else 1.0

    def price(self, op: "Op | None", context: int = 0) -> float:
        """What a planned operation behind ``context`` tokens costs: a form (``cost.seconds``, or
        one per patch formed), a patch reused ``hit`` x its form."""
        if op is None:
            return 0.0
        if isinstance(op, Reuse):
            return self.hit * self.refresh_s(op.tokens, context)
        if self.cost is not None:
            return self.cost.seconds(op)
        return float(op.counts().get("patches_formed", 0))


#: the scheduler priced in patch forms (one per patch formed, whatever its size): the default
#: before issue 22, kept for comparison (docs/replay.md, "Priced in seconds")
FORMS_WEIGHTS = Weights()
#: the scheduler priced by the cost model (seconds; see ``diverge``): the default. The live window
#: and the replay decide alike under it (tests/test_replay_matches_window.py, scheduler and valid
#: placements) since their placement views are one (docs/replay.md)
SECONDS_WEIGHTS = Weights(cost=DEFAULTS, diverge=0.35)
DEFAULT_WEIGHTS = SECONDS_WEIGHTS


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


def carried_out(decision: Decision, stored: bool) -> Decision | None:
    """The decision a window carries out (``reconcile.execute``): a store-only ``form`` the store
    cannot serve (``stored`` False) falls back."""
    d: Decision | None = decision
    while d is not None and d.action == "form" and d.reuse_only and not stored:
        d = d.fallback
    return d


def window_policy(view: PlacementView) -> PatchPolicy:
    """The patch policy the window runs (its eager one under latency-first: what the heal carries out)."""
    policy = view.patch_policy if view.patch_policy is not None else _EAGER
    return getattr(policy, "eager", policy)


_EAGER = make_policy("eager")


def planned_op(view: PlacementView, key: Key, reason: str, prefix: Sequence[Key], rank: Any = DEFAULT_RANK) -> Op | None:
    """The operation the window's patch policy plans for ``key`` behind ``prefix`` with ``reason``:
    ``Reuse`` (its patch on exactly this prefix is stored), ``Form``, ``Keep`` or ``Clear``
    (``None``: nothing to do)."""
    formed = view.formed_on.get(key, ())
    slot_of = _slot_maker(view)
    valid = len(formed) == len(prefix) and tuple(prefix) == tuple(formed)
    d = window_policy(view).decide(reason, slot_of(key), KeySlots(prefix, slot_of), valid=valid, rank=rank)
    c, t = view.content[key], view.tokens[key]
    if d.action == "form":
        pc = tuple(view.content[k] for k in prefix)
        stored = view.has_patch(c, pc)
        d = carried_out(d, stored)
        if d is not None and d.action == "form":
            kind = d.kind or "exact"
            return Reuse(c, t, kind=kind, antecedents=pc) if stored else Form(c, t, kind=kind, antecedents=pc,
                                                                               context=sum(map(view.tokens.__getitem__, prefix)))
    if d is None or d.action == "keep":
        return Keep(c, t)
    return Clear(c, t) if formed else None


def _slot_maker(view: PlacementView):
    """``key -> KeySlot`` as the patch policy sees a chunk of ``view`` (keys only; carrying a patch
    when its conditioning was formed on something)."""

    def make(key: Key) -> KeySlot:
        formed = view.formed_on.get(key, ())
        return KeySlot(key, ChunkKeys(view.content[key], view.tokens[key]), (), ("patch",) if formed else ())
    return make


def staleness_of(view: PlacementView, k: Key, prefix: Sequence[Key]) -> float:
    """The staleness score (``window.staleness``) of ``k``'s conditioning behind ``prefix``."""
    f = view.formed_on.get(k, ())
    return staleness_score([(a, view.tokens[a]) for a in f if a in view.tokens], [(a, view.tokens[a]) for a in prefix])


class Scorer:
    """Incremental costing of orders over one view: :meth:`add` extends a partial order by one
    chunk and returns its cost in seconds (each chunk's cost depends only on what precedes it), so
    a search prices a node in O(prefix) instead of re-pricing the whole order."""

    def __init__(self, view: PlacementView, entering: frozenset, w: Weights = DEFAULT_WEIGHTS,
                 asked: Sequence[Key] | None = None) -> None:
        self.view, self.entering, self.w = view, entering, w
        # the agent's asked order (None: no divergence term); a position departs from it when the
        # chunk there or anything before it differs
        self.asked = tuple(asked) if asked is not None and w.diverge else None
        self.pos = {k: i for i, k in enumerate(view.order)}
        self.context_now: dict[Key, int] = {}  # tokens in front of each resident where it stands
        n = 0
        for k in view.order:
            self.context_now[k] = n
            n += view.tokens[k]
        self._stale_now: dict[Key, float] = {}
        self._unit: float | None = None

    def stale_now(self, k: Key) -> float:
        """The staleness resident ``k`` already has where it stands."""
        if k not in self._stale_now:
            i = self.pos[k]
            self._stale_now[k] = self.staleness(k, self.view.order[:i])
        return self._stale_now[k]

    def staleness(self, k: Key, prefix: Sequence[Key]) -> float:
        return staleness_of(self.view, k, prefix)

    def unit_s(self) -> float:
        """The decision's typical form, in seconds: one form of a chunk of its mean size (residents
        and entering chunks) behind half its tokens. What the replay does not charge (staleness,
        moves, departures from the asked order) is priced in shares of it (:class:`Weights`)."""
        if self._unit is None:
            v = self.view
            toks = [v.tokens[k] for k in v.order] + [v.tokens[k] for k in self.entering]
            self._unit = self.w.refresh_s(sum(toks) // len(toks), sum(toks) // 2) if toks else 0.0
        return self._unit

    def cascade_s(self, k: Key) -> float:
        """Seconds of re-forming resident ``k`` in a recall's cascade (where it stands now: its
        place in the candidate is not known yet)."""
        return self.w.refresh_s(self.view.tokens[k], self.context_now.get(k, 0))

    def add(self, prefix: Sequence[Key], k: Key, state: tuple[frozenset, frozenset]) -> tuple[float, int, int, float, tuple[frozenset, frozenset]]:
        """Cost of ``k`` behind ``prefix``; ``state`` = (versions changed, cascade-reformed) so far.
        Returns ``(cost, forms, hits, stale, new state)``."""
        out = self._add(prefix, k, state)
        if self.asked is not None and self.diverged(prefix, k):
            return (out[0] + self.w.diverge * self.unit_s(),) + out[1:]
        return out

    def diverged(self, prefix: Sequence[Key], k: Key) -> bool:
        """Whether ``prefix + [k]`` departs from the agent's asked order."""
        a, n = self.asked, len(prefix)
        return a is None or n >= len(a) or a[n] != k or tuple(prefix) != a[:n]

    def _add(self, prefix: Sequence[Key], k: Key, state: tuple[frozenset, frozenset]) -> tuple[float, int, int, float, tuple[frozenset, frozenset]]:
        v, w = self.view, self.w
        changed, reformed = state
        if k in self.entering:
            formed = v.formed_on.get(k, ())
            op = planned_op(v, k, "recall" if formed else "append", prefix)
            c = w.price(op, sum(map(v.tokens.__getitem__, prefix)))
            n = op.counts() if op is not None else {}
            forms, hits = n.get("patches_formed", 0), n.get("patches_reused", 0)
            # its KV changes unless it is served the patch it left with on the same prefix (or the
            # canonical it had at the front)
            vchanged = bool(formed) if not prefix else (forms > 0 or tuple(prefix) != tuple(formed))
            if vchanged:
                changed = changed | {k}
                new = [d for d in v.dependents(k) if d not in reformed and d not in self.entering]
                # the recall cascade: the policy's "cascade" decision forms each (their place is not
                # known yet). Only the direct dependents are priced: the window's cascade also re-forms
                # chunks conditioned on those, and pricing them too moved the replay's latency-first
                # windows' placements apart from the live ones' (their dependents differ: not reconciled)
                if new:
                    reformed = reformed | set(new)
                    c += sum(map(self.cascade_s, new))
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
        op = planned_op(v, k, "inserted", prefix)  # something entered in front of it
        if isinstance(op, Keep):
            s = max(0.0, self.staleness(k, prefix) - (self.stale_now(k) if i is not None else 0.0))
            return (w.stale * s + w.move) * self.unit_s(), 0, 0, s, state
        n_op = op.counts() if op is not None else {}
        return (w.price(op, sum(map(v.tokens.__getitem__, prefix))) + w.move * self.unit_s(), n_op.get("patches_formed", 0),
                n_op.get("patches_reused", 0), 0.0, state)


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
