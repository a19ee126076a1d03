"""The replay's anticipation: what ``heal()`` prepares in idle time on a window with
``anticipate=True`` (``window.anticipation``), planned by the window's own planning code over the
replay's keys and priced like any other operation.

At a trace's ``step`` (the agent's idle time, where the live window heals) the replay, once the
queued work is healed, runs the window's three anticipation passes in the window's order:

1. **the next slide**: the provisional slot at index 1 gets its canonical (its patch the
   difference of its forward's KV: no second forward), as ``anticipation.anticipate_slide``;
2. **recalls**: the window's recall predictor (the same registered class, fed the same steps:
   :meth:`AnticipationMirror._observe`) predicts over a key-level view of the window
   (:class:`key_state`: what a predictor may read of a ``WindowState``); the predictions are
   ranked and cut by ``anticipation.plan_recalls``, and each recall chain is simulated on a
   snapshot of the replay's window with the eager policy's decisions, keeping only what it
   formed and stored (canonicals owed, patches);
3. **reorders**: ``anticipate_reorder.plan_reorders`` over key-only slots, each simulated the same
   way.

The trace's ``expect`` events are the agent's hints (``ContextWindow.expect``). A pass runs when
the window changed since the last one (``WindowAnticipation.anticipation_due``: its state, its
hints; a fork has its own). Idle-time work is counted in ``tokens_prefilled`` and ``heal_*``, not
in ``est_seconds``. Given an idle rate (``Replayer(idle_tokens=)``), each step's idle gap is a
``healing.HealBudget`` the heal and then these passes draw on, as ``heal(max_tokens=)`` spends it;
without one, the replay heals and anticipates to completion at every step. A preparation too dear
for a gap is continued across gaps by the window's own rule (``anticipation.ResumableForming``,
one per window, a fork's its own), the progress named by the replay's KV states. Not modelled: recall
predictions without an index (``at=None``, the window's recall placement: priced at the end,
where a trace's recalls go).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ..window.anticipate_reorder import note_reorder, plan_reorders
from ..window.anticipation import (Preparation, ResumableForming, fulfil_hints, fulfil_orders, note_hint, note_order,
                                   forming_task, plan_anticipation)
from ..window.healing import HealBudget, IdlePrices
from ..window.pending import PendingWork
from ..window.placement import END
from ..window.plan import ChunkKeys, Forward, KeySlot, Prepared
from ..window.prepared import PreparedForwards
from ..window.predictor import make_predictor
from ..window.ref import ChunkRef
from ..window.state import WindowState

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Replayer

#: the replay window's fields a simulation changes and puts back (the store, the pool's contents
#: and the costs keep what it did)
_SNAPSHOT = ("order", "logical", "formed", "window_tokens", "pending", "_state", "_formed_states", "evicted")
_COUNTS_KEPT = ("window_evictions", "stale_keeps", "cascade_reforms", "refreshes")


@dataclass(frozen=True)
class EvictedKeys:
    """An evicted chunk as a predictor sees it (``state.EvictedEntry``'s ``n_tokens`` /
    ``owes_encode``)."""

    n_tokens: int
    owes_encode: bool


@dataclass(frozen=True)
class Seen:
    """A finished window operation as a predictor observes it (``Receipt``'s ``op`` / ``refs`` /
    ``left``)."""

    op: str
    refs: tuple[ChunkRef, ...] = ()
    left: tuple[ChunkRef, ...] = ()


class KeyGraph:
    """``ConditioningGraph.preview_cascade`` over the replay's conditioning."""

    def __init__(self, eng: "Replayer") -> None:
        self._eng = eng

    def preview_cascade(self, ref: ChunkRef, order: Sequence[ChunkRef]) -> tuple[ChunkRef, ...]:
        eng = self._eng
        reach = eng._descendants(eng._key_of[ref])
        return tuple(r for r in order if eng._key_of[r] in reach)


def key_state(eng: "Replayer") -> WindowState:
    """The replay's window as a recall predictor and the reorder planner read it: a
    ``WindowState`` of key-only slots (in order), the evicted chunks (eviction order) and the
    replay's conditioning as its graph (``preview_cascade``)."""
    return WindowState(slots=tuple(eng.anticipation_slot(k) for k in eng.order),  # type: ignore[arg-type]
                       # (a canonical owed that an earlier preparation stored: owed no more, ``predictor.as_predicted``)
                       evicted={eng.ref_of(k): EvictedKeys(eng.tokens[k], k in eng.pending.owes and not eng.canonical_stored(k))
                                for k in eng.evicted},  # type: ignore[misc]
                       graph=KeyGraph(eng))  # type: ignore[arg-type]


class AnticipationMirror:
    """The anticipation bookkeeping and passes of :class:`~.engine.Replayer` (a mixin)."""

    def _init_anticipation(self, on: bool, predictor: Any) -> None:
        self._anticipating = on
        self.predictor = make_predictor(predictor)  # per window family: a fork shares it
        self.reorders_seen: Counter = Counter()
        self.expected: dict[tuple[ChunkRef, ...], Any] = {}  # the current window's hints
        self.expected_orders: list[tuple[ChunkRef, ...]] = []  # ... and its order hints
        self.evicted: dict[str, None] = {}  # evicted keys, in eviction order (what each owes: ``pending.owes``)
        self._key_of: dict[ChunkRef, str] = {}
        self._generations = count(1)
        self._generation = 0  # changes with the window (``WindowState`` identity and generation)
        self._anticipated_for: tuple | None = None
        self._simulating = False
        # prepared re-forwards (``window.prepared``, its bound: keys only): (content, antecedent states)
        self._prepared = PreparedForwards()
        # the KV states behind the last prepared re-forward (None: a forward ran since): the next
        # one there joins its forward (``ingest.reforward_run``: one forward of consecutive chunks)
        self._open_run: tuple | None = None
        self.forming = ResumableForming()  # forming carried across idle gaps (the window's, per window)

    # ------------------------------------------------------------------ bookkeeping
    def _changed(self) -> None:
        self._generation = next(self._generations)

    def ref_of(self, key: str) -> ChunkRef:
        ref = self._refs[key]
        self._key_of[ref] = key
        return ref

    def canonical_stored(self, key: str) -> bool:
        """Whether ``key``'s canonical is in the store (the window's ``WindowStore.has``)."""
        return bool(self.arm.canonicals) and self.pool.contains(("c", self.content[key]))

    def anticipation_slot(self, key: str) -> KeySlot:
        """``key`` as a slot of :class:`key_state` (provisional: latency-first content with no
        canonical yet)."""
        formed = self.formed.get(key, ())
        return KeySlot(self.ref_of(key), ChunkKeys(self.content[key], self.tokens[key]),
                       tuple((self.ref_of(a), "") for a in formed), ("patch",) if formed else (), self.pending.provisional(key))

    def _observe(self, op: str, keys: Sequence[str] = (), left: Sequence[str] = ()) -> None:
        """The predictor learns from a finished window operation, as ``ContextWindow._record``
        lets it (heal and anticipation steps are not the agent's: the session predictor skips them)."""
        if not self._anticipating:
            return
        if op == "recall":  # (``WindowAnticipation._observe``: a recall fulfils its hints, a reorder its order)
            self.expected = fulfil_hints(self.expected, tuple(map(self.ref_of, keys)))
        elif op == "reorder" and self.expected_orders:
            self.expected_orders = fulfil_orders(self.expected_orders, tuple(map(self.ref_of, self.order)))
        self.predictor.observe(Seen(op, tuple(map(self.ref_of, keys)), tuple(map(self.ref_of, left))), key_state(self))

    def note_reorder(self, before: Sequence[str], after: Sequence[str]) -> None:
        note_reorder(self.reorders_seen, before, after)

    def expect(self, key: str, at: int | None) -> None:
        """A trace's ``expect`` event (``ContextWindow.expect`` of an evicted chunk; None: the end)."""
        if key in self.evicted:
            note_hint(self.expected, (self.ref_of(key),), END if at is None else at)

    def expect_order(self, order: Sequence[str]) -> None:
        """A trace's ``expect`` event with an order (``ContextWindow.expect_order``, as the trace
        executor asks it: the named chunks the window holds or will recall, then any others)."""
        known = set(self.order) | set(self.evicted)
        named = [c for c in order if c in known]
        rest = [c for c in self.order if c not in set(named)]
        note_order(self.expected_orders, tuple(map(self.ref_of, named + rest)))

    def _anticipation_token(self) -> tuple:
        return (self._generation, tuple(self.expected.items()), tuple(self.expected_orders))

    @property
    def anticipation_due(self) -> bool:
        return self._anticipating and self._anticipated_for != self._anticipation_token()

    def _fork_anticipation(self) -> tuple:
        """A fork: its own hints and anticipation (the parent's, returned, come back after it)."""
        saved = (self.expected, self.expected_orders, self._anticipated_for, self._generation, self.forming)
        self.expected, self.expected_orders, self._anticipated_for, self.forming = {}, [], None, ResumableForming()
        self._changed()
        return saved

    def _end_fork_anticipation(self, saved: tuple, committed: bool) -> None:
        self.expected, self.expected_orders, self._anticipated_for, self._generation, self.forming = saved
        if committed:  # the parent now holds the fork's state
            self._changed()

    # ------------------------------------------------------------------ the passes
    def anticipate(self, budget: HealBudget | None = None) -> None:
        """The window's anticipation passes once nothing is queued (see the module doc), on what is
        left of ``budget`` (an idle gap: ``healing.HealBudget``, the rule the window's ``heal``
        spends it by: a preparation whose estimated cost does not fit is skipped, and the pass is
        then not complete); charged as idle-time work (``heal_*``)."""
        # (a window that forms no patches still simulates its predicted recalls: their canonicals'
        # reads are its store traffic)
        if not self.anticipation_due:
            self._anticipated_for = self._anticipation_token()
            return
        budget = budget if budget is not None else HealBudget()
        idle = self._idle_start()
        healing, self._healing = self._healing, True
        complete = True
        self._prepared.new_pass()  # (as the window's pass: what earlier passes kept goes first)
        forming = self.forming
        forming.begin_pass()
        try:
            for run, cost, work in self._anticipation_tasks(budget.bounded):
                if not budget.fits(forming.cost(work, cost)):
                    complete = False
                    forming.missed(work)
                    continue  # too dear for what is left (started with the gap's rest)
                tokens, forwards, factorized, spent = self.r.tokens_prefilled, self.r.forwards, self._factorized(), budget.tokens
                run()
                if self.r.tokens_prefilled > tokens or self.r.forwards > forwards or self._factorized() != factorized:
                    budget.spend(self.r.tokens_prefilled - tokens, *self._factorized_since(factorized),
                                 forwards=self.r.forwards - forwards)
                forming.ran(work, budget, spent)
            forming.end_pass(budget)
        finally:
            self._healing = healing
        self._idle_end(idle)
        if complete:
            self._anticipated_for = self._anticipation_token()

    def _anticipation_tasks(self, budgeted: bool) -> Iterator[tuple[Callable[[], Any], float | None, tuple]]:
        """The window's anticipation tasks (``anticipation.plan_anticipation``) over the replay's
        keys: ``(run, cost_tokens, forming)``, most valuable first (forming:
        ``anticipation.forming_task`` on the window's KV states as the task comes up)."""
        slide = self.tokens[self.order[1]] if len(self.order) >= 2 and self.order[1] in self.pending.uncanonical else None
        prices = IdlePrices(self.factorization_cost, self.factorization_fixed, self.forward_fixed)
        tasks = plan_anticipation(lambda: key_state(self), self.predictor, self.expected, self.expected_orders, budgeted,
                                  prices, slide,
                                  lambda: plan_reorders(self.eager, self.reorders_seen, self.expected_orders,
                                                        key_state(self).slots))
        for task in tasks:

            def run(task: Preparation = task) -> None:
                task.ran = True
                if task.kind in ("slide", "canonical"):
                    key = (self.order[1] if len(self.order) >= 2 else None) if task.kind == "slide" else \
                        self._key_of[task.order[0]]
                    if self._anticipate_canonical(key):
                        self._changed()
                        self.pool.install(self.order)  # (a window operation: its slot holds what it formed)
                elif task.kind == "recalls":
                    self._simulated(self._simulate_recalls, (task.recalls, task.orders))
                else:
                    self._simulated(self._simulate_reorder, [self._key_of[ref] for ref in task.order])

            yield run, task.cost, forming_task(task, [self._kv_state(k) for k in self.order], key_state(self), prices,
                                               whole=self.cfg.budget_tokens is not None)

    def _anticipate_canonical(self, key: str | None) -> bool:
        """``anticipation.anticipate_canonical`` (``anticipate_slide``: the slot at index 1): the
        provisional slot ``key`` gets its canonical (and, where its forward ran behind exactly the
        slots in front of it as they stand, the difference as its stored patch), then the eager
        policy's ``append`` decision there (a store hit)."""
        if key is None or key not in self.order or key not in self.pending.uncanonical:
            return False
        prefix = self.order[:self.order.index(key)]
        valid = self.valid(key, prefix)
        self.pending.canonicalized(key)
        self._encode(key)
        if valid and not self._is_stored(key, prefix, "exact"):
            self._difference(key, prefix)
        self._set_formed(key, ())
        self.carry_out(key, prefix, self.decide("append", key, prefix))
        return True

    def _reforward_prepared(self, key: str, prefix: Sequence[str]) -> bool:
        """A provisional chunk the latency-first policy would defer to the heal's re-forward behind
        ``prefix`` (``reconcile``'s ``prepared``): in a simulation the forward runs now and is kept
        (``"run"``); in a window operation the one kept for exactly these antecedent states is taken
        (``"take"``: no forward, nothing queued). Returns whether it was handled."""
        if not (self._defers and self._lazy and self._anticipating) or not prefix or key not in self.pending.uncanonical:
            return False
        states = (self.content[key], tuple(map(self._kv_state, prefix)))
        kept = self._prepared.get(states) is not None  # (found: it belongs to this pass, as the window's)
        if self._simulating and not kept:  # (one kept already: nothing to run)
            # right behind the chunk re-forwarded last, nothing run since: one forward of both
            joined = self._open_run is not None and self._open_run == states[1]
            self.do(Forward(self.content[key], self.tokens[key], context=sum(map(self.tokens.__getitem__, prefix)),
                            joined=joined))
            self._prepared.put(states, True, nbytes=0)
            self._set_formed(key, tuple(prefix), "inline")
            self._open_run = (*states[1], self._kv_state(key))
            return True
        elif self._simulating:
            pass
        elif kept:
            self.do(Prepared(self.content[key], self.tokens[key], antecedents=tuple(self.content[p] for p in prefix)))
            self.pending.pop(key)  # (nothing left queued for it)
        else:
            return False
        self._set_formed(key, tuple(prefix), "inline")
        return True

    def _simulated(self, body: Any, arg: Any) -> None:
        """Run ``body(arg)`` on the replay's window and put the window back as it was: the store,
        the pool's contents and the costs keep what it formed (``anticipation``: a simulation on a
        copy of the state)."""
        saved = {name: _copied(getattr(self, name)) for name in _SNAPSHOT}
        self._open_run = None
        slots = self.pool.snapshot()
        kept = {name: getattr(self.r, name) for name in _COUNTS_KEPT}
        self._simulating = self.pool.simulating = True
        try:
            body(arg)
        finally:
            self._simulating = self.pool.simulating = False
            for name, value in saved.items():
                setattr(self, name, value)
            self.pool.restore(slots)
            for name, value in kept.items():
                setattr(self.r, name, value)
            self._formed_set = {}

    def _simulate_recalls(self, chain: tuple) -> None:
        """``anticipation.anticipate_recalls``: each recall on the arrangement the ones before it
        leave (a recall of a chunk no longer evicted ends the chain), then the first of the order
        hints that reorders the arrangement the chain leaves."""
        recalls, orders = chain
        for ref, at in recalls:
            key = self._key_of[ref]
            if key not in self.evicted:
                break
            self._admit(-1, [(key, at if isinstance(at, int) else None)], True)
        refs = tuple(map(self.ref_of, self.order))
        then = next((o for o in orders if set(o) == set(refs) and tuple(o) != refs), None)
        if then is not None:
            self._simulate_reorder([self._key_of[r] for r in then])

    def _simulate_reorder(self, order: list[str]) -> None:
        """``anticipate_reorder.anticipate_reorder``: the eager policy's decisions on the order."""
        if order == self.order or sorted(order) != sorted(self.order):
            return
        self.order = list(order)
        self._reorder_slots(self.order)


def _copied(value: Any) -> Any:
    """A shallow copy of a snapshot field (lists, dicts, sets and the pending record; numbers as they are)."""
    return value.copy() if isinstance(value, (list, dict, set, PendingWork)) else value
