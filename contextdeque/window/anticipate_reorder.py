"""Reorder anticipation: in idle time, form the patches the likely next reorders of the current set
need (the seed paper's orbit lane: a reorder of a cached set served by stored patches), so that
such a reorder runs no forward on the critical path and equals the eager policy's window.

Which orderings to prepare is priced per candidate:

- **probability** ``p``: an order the agent named (:meth:`~.anticipation.WindowAnticipation.expect_order`)
  is certain; otherwise the prior of its shape (:data:`REORDER_PRIORS`: the reverse, a swap of
  neighbours, one chunk moved to the end — a relevant page next to the question —, or to the front)
  mixed with this window family's own reorders so far (``WindowContext.reorders_seen``, index
  permutations with counts; :data:`PRIOR_WEIGHT` pseudo-counts of prior);
- **cost**: the patches the eager policy would form for it (:func:`patch_needs`: a fresh exact
  patch is one forward; an orbit patch, for a slot whose antecedent *set* is unchanged, one per
  ordering averaged) and their tokens;
- **benefit**, per patch: the probability of every candidate order that needs it (an orbit patch
  serves every ordering of its set: a swap at the front and one in the middle share the last
  page's) x the tokens it keeps from being served blind or stale (the front slot needs none: its
  canonical is exact and free).

Candidates are taken greedily by the benefit of the patches they still need per token forming
them costs (what an order taken before formed is free), at most :data:`ANTICIPATED_REORDERS` per
idle period and none below :data:`MIN_SAVED_PER_FORMED`, each one transaction that only reads the
window: the reorder is simulated on a copy of
the state with the eager policy's decisions (``reconcile``), and what it forms goes to the store
under the usual keys (which name the antecedents' states, ``window.kvstate``). A reorder that
lands in exactly that arrangement finds every patch; another finds what it shares with it (an
orbit patch serves every ordering of its set of settled antecedents).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Hashable, Sequence

from .plan import Forward
from .policy_latency import HealPolicy
from .receipt import Meter
from .reconcile import reconcile
from .ref import ChunkRef
from .slot import Slot
from .state import WindowState

if TYPE_CHECKING:  # pragma: no cover
    from .plan import KeySlot
    from .window import ContextWindow

ANTICIPATED_REORDERS = 6
"""Reorder arrangements prepared per idle period at most (the most valuable first)."""

MIN_SAVED_PER_FORMED = 0.05
"""Reorder anticipation's price floor: an order is prepared only while the tokens it is expected
to keep from being served blind (probability x tokens, summed over the patches it still needs)
are at least this share of the tokens forming them costs. Orders the family's statistics give ~0
probability, or orbit patches that cost many forwards for little expected use, are left to the
heal after the step; an order the agent named is always prepared. (The reorder prior sums to 1,
so the floor is absolute; recall predictors' probabilities are not calibrated that way: a cold
session gives the page that just left p = 0.04-0.05.)"""

MAX_PRIOR_SLOTS = 12
"""Windows of more slots get no prior candidates (hints and the family's own reorders only)."""

REORDER_PRIORS = {"reverse": 0.25, "swap": 0.25, "to-end": 0.3, "to-front": 0.2}
"""Prior probability mass of each reorder shape (spread evenly over its members): the reverse
(newest first), a swap of two neighbours (a re-rank), one chunk moved to the end (next to the
question: the doc trace's relevant page) or to the front."""

PRIOR_WEIGHT = 4.0
"""Pseudo-counts of the prior against the family's observed reorders."""

Perm = tuple[int, ...]


def note_reorder(seen: "Counter[Perm]", before: Sequence[Hashable], after: Sequence[Hashable]) -> None:
    """Count the reorder ``before`` -> ``after`` (an index permutation) in ``seen``, a window
    family's statistics (``WindowContext.reorders_seen``; the replay keeps its own)."""
    index = {r: i for i, r in enumerate(before)}
    perm = tuple(index[r] for r in after)
    if perm != tuple(range(len(perm))):
        seen[perm] += 1


def prior_orders(n: int) -> dict[Perm, float]:
    """The prior over index permutations of ``n`` slots (see :data:`REORDER_PRIORS`); the
    identity is left out (it costs nothing)."""
    if n < 2 or n > MAX_PRIOR_SLOTS:
        return {}
    ident = list(range(n))
    shapes: dict[str, list[Perm]] = {
        "reverse": [tuple(reversed(ident))],
        "swap": [tuple(ident[:i] + [i + 1, i] + ident[i + 2:]) for i in range(n - 1)],
        "to-end": [tuple(ident[:i] + ident[i + 1:] + [i]) for i in range(n - 1)],
        "to-front": [tuple([i] + ident[:i] + ident[i + 1:]) for i in range(1, n)],
    }
    out: dict[Perm, float] = {}
    for shape, perms in shapes.items():
        for p in perms:
            if p != tuple(ident):
                out[p] = out.get(p, 0.0) + REORDER_PRIORS[shape] / len(perms)
    return out


def order_probabilities(reorders_seen: "Counter[Perm]", n: int) -> dict[Perm, float]:
    """``perm -> p``: the prior mixed with the family's observed reorders of ``n`` slots."""
    prior = prior_orders(n)
    seen = {p: c for p, c in reorders_seen.items() if len(p) == n}
    total = sum(seen.values())
    out = {p: PRIOR_WEIGHT * q / (total + PRIOR_WEIGHT) for p, q in prior.items()}
    for p, c in seen.items():
        out[p] = out.get(p, 0.0) + c / (total + PRIOR_WEIGHT)
    return out


Need = tuple
"""A patch a reorder needs, named across candidate orders: ``("exact", chunk id, antecedent ids in
order)``, ``("orbit", chunk id, frozenset of antecedent ids)`` (an orbit patch is formed on
settled antecedents and serves every ordering of its set: ``window.kvstate``), ``("reforward",
chunk id, antecedent ids in order)`` (a provisional chunk's prepared re-forward) or ``("canonical",
chunk id, ())`` (a provisional chunk's canonical, for the front)."""


def patch_needs(slots: "Sequence[Slot | KeySlot]", eager: object) -> list[tuple[Need, int, int]]:
    """The patches the eager policy would form for ``slots`` (the window in its new order), each
    ``(need, forwards, tokens of the slot)``, without running anything: a slot whose antecedents
    (by id, in order) are unchanged and all in front of it unchanged keeps its KV; the front slot
    takes its canonical; any other takes an orbit patch (its antecedent set unchanged, within the
    policy's orbit limits: one forward per ordering) or an exact one. A provisional slot that
    moves (latency-first new content with no canonical: the reorder defers its conditioned
    re-forward to ``heal``) needs that re-forward behind its new prefix, one forward kept in
    ``window.prepared`` for the reorder to take (``("reforward", chunk id, antecedent ids)``).
    A provisional slot that reaches the front needs its canonical there (``("canonical", chunk id,
    ())``, one forward: ``anticipation.anticipate_canonical`` makes it where the slot stands, and
    the reorder then serves it exact)."""
    orbit_max = int(getattr(eager, "orbit_max_antecedents", 0)) if getattr(eager, "reorder", "orbit") == "orbit" else 0
    max_orderings = int(getattr(eager, "max_orderings", 1))
    needs: list[tuple[Need, int, int]] = []
    changed_in_front = False
    for i, slot in enumerate(slots):
        before = tuple(s.ref for s in slots[:i])
        carried = tuple(r for r, _ in slot.conditioned_on)
        if carried == before and not changed_in_front:
            continue
        changed_in_front = True
        if slot.provisional and not before:
            needs.append((("canonical", slot.ref.chunk_id, ()), 1, slot.n_tokens))
            continue
        if not before:
            continue  # the canonical: exact at the front, free
        ids = tuple(r.chunk_id for r in before)
        if slot.provisional:
            needs.append((("reforward", slot.ref.chunk_id, ids), 1, slot.n_tokens))
            continue
        if sorted(r.chunk_id for r in carried) == sorted(ids) and len(before) <= orbit_max:
            needs.append((("orbit", slot.ref.chunk_id, frozenset(ids)), min(math.factorial(len(before)), max_orderings),
                          slot.n_tokens))
        else:
            needs.append((("exact", slot.ref.chunk_id, ids), 1, slot.n_tokens))
    return needs


def estimated_cost(slots: "Sequence[Slot | KeySlot]", eager: object) -> tuple[int, int, int]:
    """``(forwards, tokens formed, tokens fixed)`` the eager policy would spend on ``slots`` (the
    window in its new order): :func:`patch_needs` summed."""
    needs = patch_needs(slots, eager)
    return (sum(n for _, n, _ in needs), sum(n * t for _, n, t in needs), sum(t for _, _, t in needs))


def reorder_candidates(win: "ContextWindow", state: WindowState) -> list[list[ChunkRef]]:
    """The orders worth preparing, most valuable first (see the module doc), at most
    :data:`ANTICIPATED_REORDERS` (:func:`plan_reorders` over the window's slots)."""
    ctx = win._ctx
    return plan_reorders(getattr(ctx.policy, "eager", ctx.policy), ctx.reorders_seen, win.expected_orders, state.slots)


def plan_reorders(eager: object, reorders_seen: "Counter[Perm]", expected_orders: Sequence[Sequence[ChunkRef]],
                  slots: "Sequence[Slot | KeySlot]") -> list[list[ChunkRef]]:
    """The reorders of ``slots`` (the window in order: :class:`~.slot.Slot` or, in the replay,
    key-only :class:`~.plan.KeySlot` objects) worth preparing, most valuable first, at most
    :data:`ANTICIPATED_REORDERS`: the planning both the window and the replay run.

    Priced per patch, not per order: a patch's value is the probability of the orders that need
    it (an orbit patch serves every ordering of its set, an exact one every order with the same
    prefix) x the tokens it keeps from being served blind; an order's score is the value of the
    patches it still needs over the tokens forming them costs (what an order chosen before formed
    is free). Orders are taken greedily, best score first, while the score is at least
    :data:`MIN_SAVED_PER_FORMED` (an order the agent named, ``expect_order``, always; only such an
    order is prepared when it brings a provisional chunk to the front, whose canonical is then
    made where it stands: a change to the window, not taken on a guess)."""
    refs = [s.ref for s in slots]
    probs = order_probabilities(reorders_seen, len(refs))
    hinted: set[Perm] = set()
    for order in expected_orders:
        if sorted(order, key=lambda r: r.key) == sorted(refs, key=lambda r: r.key):
            perm = tuple(refs.index(r) for r in order)
            hinted.add(perm)
            probs[perm] = 1.0
    needs_of: dict[Perm, dict[Need, tuple[int, int]]] = {}
    value: dict[Need, float] = {}
    for perm, p in probs.items():
        needs = patch_needs([slots[j] for j in perm], eager)
        if not needs or (perm not in hinted and any(need[0] == "canonical" for need, _, _ in needs)):
            # nothing to form; or a guessed order would need a canonical made where the chunk stands
            # now, which changes the window (its exact forward for canonical + patch): named orders only
            continue
        needs_of[perm] = {need: (forwards, tokens) for need, forwards, tokens in needs}
        for need, _, tokens in needs:
            value[need] = value.get(need, 0.0) + p * tokens
    order_index = {perm: i for i, perm in enumerate(probs)}
    chosen: list[Perm] = []
    covered: set[Need] = set()
    while needs_of and len(chosen) < ANTICIPATED_REORDERS:
        best: tuple[float, float, int, Perm] | None = None
        for perm, needs in needs_of.items():
            new = [n for n in needs if n not in covered]
            if not new:
                continue
            formed = sum(needs[n][0] * needs[n][1] for n in new)
            score = math.inf if perm in hinted else sum(value[n] for n in new) / max(formed, 1)
            key = (score, probs[perm], -order_index[perm], perm)
            if best is None or key > best:
                best = key
        if best is None or best[0] < MIN_SAVED_PER_FORMED:
            break
        perm = best[3]
        chosen.append(perm)
        covered.update(needs_of.pop(perm))
    return [[refs[j] for j in perm] for perm in chosen]


def anticipate_reorder(win: "ContextWindow", state: WindowState, order: Sequence[ChunkRef], meter: Meter) -> bool:
    """Form and store the patches ``reorder(order)`` would need now (the eager policy's decisions
    on a simulated copy; the state is only read). Returns whether anything was formed."""
    ctx = win._ctx
    if list(state.refs) == list(order) or sorted(state.refs, key=lambda r: r.key) != sorted(order, key=lambda r: r.key):
        return False  # the window moved on since the order was planned
    by_ref = {s.ref: s for s in state.slots}
    slots = [by_ref[r] for r in order]
    eager = getattr(ctx.policy, "eager", ctx.policy)
    before, ops = len(meter.formed_keys), len(meter.plan.ops)
    reconcile(ctx, slots, {r: "reorder" for r in order}, meter, policy=HealPolicy(eager), prepared="run")
    ctx.anticipated_keys.update(meter.formed_keys[before:])  # what it formed (a stored patch it reused is not its own)
    return len(meter.formed_keys) > before or any(isinstance(op, Forward) for op in meter.plan.ops[ops:])
