"""The replay's latency-first bookkeeping: the heal at a step boundary (the conditioning the
latency-first policy deferred, the canonicals owed, the recall cascade's re-forms), what a chunk
leaving the window before it was healed leaves behind, and the idle-time accounting. A mixin of
:class:`~.engine.Replayer`; what is owed per chunk key is the ``Replayer.pending`` record
(``window.pending.PendingWork``, the one the live window keeps), changed through its transitions."""

from __future__ import annotations

from typing import Sequence

from ..window.healing import HealBudget, HealNeed, IdlePrices, plan_heal_step
from ..window.plan import Difference
from ..window.staleness import staleness_score


class HealMirror:
    """The heal of :class:`~.engine.Replayer` (see the module doc)."""

    def _difference(self, key: str, prefix: Sequence[str]) -> None:
        """The patch of ``key`` on ``prefix`` taken from its provisional forward (an SVD, no
        forward: ``Difference``), stored."""
        t, pc = self.tokens[key], tuple(self.content[p] for p in prefix)
        pb = self.cost.patch_bytes(t, self.rank)
        tier = self.pool.write(self._patch_key(key, prefix, "exact"), pb)
        self.do(Difference(self.content[key], t, antecedents=pc, tier=tier, nbytes=pb))
        self.r.patch_bytes += pb
        self.graph.add(self.content[key], pc, "exact")
        self._store(key, prefix, "exact")

    def _has_heal_work(self) -> bool:
        return self._defers and self.pending.heal_work()

    def _has_pending(self) -> bool:
        """In-window work queued for the heal (``ContextWindow.pending_refs``: what makes the
        trace executor heal at a step; chunks that left unhealed wait for a heal called anyway)."""
        return self._defers and self.pending.queued_work()

    def heal(self, budget: HealBudget | None = None) -> None:
        """Latency-first: the idle-time work queued since the last heal, on the window as it stands
        (canonicals of provisional chunks, whose patch is their difference: no second forward; the
        eager policy's conditioning for chunks that waited, store hits first; the recall cascade of
        those that were recalled). Under a ``budget`` (an idle gap: ``healing.HealBudget``) in the
        window's steps (``healing.heal_batch``: the stalest pending chunk and the pending ones in
        front of it; then, with nothing pending, one canonical owed by a chunk that left per step:
        ``healing.plan_heal_step``), until it is spent; without one, every step (as ``heal()`` runs
        them). Counted in ``tokens_prefilled`` and ``heal_*``, not in ``est_seconds``."""
        if not self._has_heal_work():
            return
        budget = budget if budget is not None else HealBudget()
        self._forget_departed()
        while (self._pending_keys() or self.pending.departed) and budget.allows_step():
            idle, factorized = self._idle_start(), self._factorized()
            # the window's step (``healing.plan_heal_step``): its batch, or one canonical owed by a
            # chunk that left (``_unhealed_evicted``, in eviction order)
            tasks = plan_heal_step(self.order, self._pending_keys(), self._heal_priority, self._heal_need,
                                   list(self.pending.departed))
            if tasks[0].need == "departed":
                self._heal_pass(set(), owed=tasks[0].key)
            else:
                self._heal_pass({t.key for t in tasks})
            budget.spend(self.r.tokens_prefilled - idle[0], *self._factorized_since(factorized), forwards=self.r.forwards - idle[1])
            self._idle_end(idle)
            self.pool.install(self.order)  # (each step is one window operation)

    def _forget_departed(self) -> None:
        """Drop the queued work of chunks no longer in the window (gone with a discarded fork):
        the window's queue holds residents only."""
        departed = self.pending.forget_outside(self.order)
        if departed:
            self._heal_pass(departed)

    def _idle_step(self, max_tokens: int) -> None:
        """``heal(max_tokens=)`` at a step (nothing when the gap affords no token): the queued work
        and then, once none is left, anticipation, on one budget (``healing.HealBudget``)."""
        if max_tokens <= 0:
            return
        budget = HealBudget(max_tokens=max_tokens,
                            prices=IdlePrices(self.factorization_cost, self.factorization_fixed, self.forward_fixed))
        self.heal(budget)
        if not self._pending_keys():
            self.anticipate(budget)

    def _pending_keys(self) -> set[str]:
        """The window's ``state.pending``, over keys: resident chunks queued for the heal."""
        return self.pending.heal_keys(self.order)

    def _heal_need(self, key: str, index: int) -> HealNeed:
        """``healing.heal_need`` of a queued chunk, from what it owes (``PendingWork.heal_need``)."""
        return self.pending.heal_need(key, index, self._lazy)

    def _heal_priority(self, key: str) -> float:
        """``ContextWindow.heal_priority`` over keys: the staleness of what ``key`` carries (a
        provisional chunk: the KV it ran after) behind what is in front of it now."""
        i = self.order.index(key)
        tok = self.tokens.__getitem__
        formed, states = self.formed.get(key, ()), self._formed_states.get(key, ())
        carried = [] if len(states) != len(formed) else [((a, st), tok(a)) for a, st in zip(formed, states)]
        return staleness_score(carried, [((p, self._kv_state(p)), tok(p)) for p in self.order[:i]])

    def _heal_pass(self, keys: set[str], owed: str | None = None) -> None:
        """Heal the queued work of ``keys`` (one step's batch: ``plan_heal_step``), or the
        canonical ``owed`` by a chunk that left."""
        self._changed()
        self._healing = True
        try:
            resident = set(self.order)
            pending = self.pending
            if owed is not None and pending.take_departed(owed) and owed not in resident:
                self._encode(owed)
                pending.clear_owed(owed)
            front = self.order[0] if self.order else None
            for key in sorted(pending.canonical_due & resident & keys, key=self.order.index):
                i = self.order.index(key)
                need = self._heal_need(key, i)  # (while it is still due)
                pending.canonical_due.discard(key)
                if key not in pending.uncanonical:
                    continue
                if need == "canonical":  # its forward's KV is stale at the front, where the canonical is exact
                    pending.canonicalized(key)
                    self._encode(key)
                    self._set_formed(key, ())
                elif need == "reforward" and key not in pending.queued:  # something came in front of it
                    self._form(key, self.order[:i])  # meanwhile: re-forwarded behind that (once: a queued
                    # re-form does it below)
            # a forward's KV differs from its canonical + patch once the chunks it ran after are
            # healed themselves (their KV changes): the difference is then no patch for the window
            # as it stands, and the eager policy forms one anew (what ContextWindow.heal does)
            healed_before: set[str] = set()
            anew: set[str] = set()
            queued = (set(pending.forwarded) | set(pending.queued)) & keys
            for key in self.order:
                if key in pending.forwarded and key in keys and healed_before:
                    anew.add(key)
                if key in queued:
                    healed_before.add(key)
            for key in [k for k in pending.forwarded if k in keys]:
                need = self._heal_need(key, self.order.index(key)) if key in resident else None
                pc = pending.take_forwarded(key)
                if need is None:  # gone with a discarded fork: its canonical is never made
                    k = ("c", self.content[key])
                    if k not in self.pool.pinned:
                        self.pool.drop(k)
                    continue
                if need != "canonical":
                    # kept as forwarded, or (queued to re-form) re-forwarded behind its new prefix
                    # below: either way no canonical until a stored patch could serve it
                    pending.keep_uncanonical(key)
                    continue
                self._encode(key)
                prefix = tuple(self.order[: self.order.index(key)])
                if key == front:  # at the front the canonical is exact: its KV from now on
                    self._set_formed(key, ())
                elif pc and key not in anew and self._prefix_content(key) == pc and \
                        self._formed_states.get(key) == tuple(map(self._kv_state, prefix)):
                    self._difference(key, prefix)  # latency-shared: the patch is the difference
                    self._read_patch(key, prefix, "exact")  # (the eager policy's store hit on it)
                    self._set_formed(key, prefix)
                else:  # moved since its forward, or what it ran after was healed: the eager policy forms anew
                    pending.defer(key)
                    anew.add(key)
            pos = {k: i for i, k in enumerate(self.order)}
            for key, queued_as in sorted([kv for kv in pending.queued.items() if kv[0] in keys],
                                         key=lambda kv: pos.get(kv[0], -1)):
                pending.pop(key)
                force, reason = queued_as.cascade, queued_as.reason
                i = pos.get(key)
                if i is None:
                    continue
                prefix = self.order[:i]
                if not prefix:
                    self._set_formed(key, ())
                elif force or key in anew or tuple(prefix) != self.formed.get(key, ()):
                    if force:
                        self.r.cascade_reforms += 1
                    reason = "cascade" if force else reason
                    if key in anew or key in pending.uncanonical or reason is None:
                        self._form(key, prefix)
                    else:  # the eager policy's decision on the slot as it was deferred (what it carried)
                        self.carry_out(key, prefix, self.decide(reason, key, prefix))
        finally:
            self._healing = False

    def _idle_start(self) -> tuple[int, int, float]:
        return self.r.tokens_prefilled, self.r.forwards, self.r.est_seconds

    def _factorized(self) -> tuple[int, int]:
        """``(tokens, patches)`` factorized so far (``Replayer.do``: what an idle budget charges for)."""
        return self.factorized_tokens, self.factorized_patches

    def _factorized_since(self, start: tuple[int, int]) -> tuple[int, int]:
        """``(tokens, patches)`` factorized since ``start`` (:meth:`_factorized`): ``HealBudget.spend``'s."""
        return self.factorized_tokens - start[0], self.factorized_patches - start[1]

    def _idle_end(self, start: tuple[int, int, float]) -> None:
        """What ran since ``start`` (``_idle_start``) was idle time: ``heal_*``, not ``est_seconds``."""
        r = self.r
        tok0, fw0, est0 = start
        r.heal_tokens += r.tokens_prefilled - tok0
        r.heal_forwards += r.forwards - fw0
        r.heal_seconds += r.est_seconds - est0
        r.est_seconds = est0

    def _leave(self, key: str) -> None:
        self.window_tokens -= self.tokens[key]
        if not self.arm.canonicals:
            return
        k = ("c", self.content[key])
        self.pool.release(k, key)
        self.pool.condition(key, None)
        # its queued work goes; left with no canonical computed it owes one (a recall or, under
        # ``latency-shared``, the heal encodes it: ``EvictedEntry.owes_encode``)
        if self._defers and self.pending.leave(key, k in self.pool.pinned, self._lazy) and not self._simulating:
            self.pool.drop(k)  # its canonical was never computed: nothing of it stays
