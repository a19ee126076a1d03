"""The replay's recall cascade, as ``window.reconcile`` decides it: which residents a recall
re-forms (conditioned, transitively, on the recalled chunk, and either behind it now or formed on
KV of it that the recall changed) and the eager policy's ``cascade`` decision for each. A mixin of
:class:`~.engine.Replayer`, which owns the window state it reads (``order``, ``formed``,
``_formed_states``, ``_before_op`` / ``_before_states``: the conditioning before the operation)."""

from __future__ import annotations


class CascadeMirror:
    """The recall cascade of :class:`~.engine.Replayer` (see the module doc)."""

    def dependents(self, key: str) -> list[str]:
        """Residents whose conditioning was formed with ``key`` among its antecedents (window order)."""
        out = []
        fs = self._formed_set
        for d in self.order:
            s = fs.get(d)
            if s is None:
                s = fs[d] = frozenset(self.formed.get(d, ()))
            if key in s:
                out.append(d)
        return out

    def _cascade(self, recalled: str, changed: bool, entering: set[str], lo: int = 0, hi: int | None = None,
                 run: dict | None = None) -> dict:
        """The recall cascade, as ``window.reconcile`` decides it: in window order, a resident that
        transitively depends on ``recalled`` re-forms when it was conditioned on ``recalled`` and
        that chunk's KV ``changed`` or now sits behind it, or on a chunk already in the cascade,
        or on a dependent that now sits behind it. Looks at ``order[lo:hi]``; ``run``: what an
        earlier call of the same cascade found (returned, to go on with the next slots)."""
        if run is None:
            run = self._cascade_run(recalled)
        if not run["candidates"]:
            return run
        for i in range(lo, len(self.order) if hi is None else hi):
            d = self.order[i]
            if self._in_cascade(run, i, d, recalled, changed) and d not in entering and d not in self._not_kept:
                self._cascade_reform(i, d)
        return run

    def _cascade_run(self, recalled: str) -> dict:
        """A recall cascade's bookkeeping: the conditioning it is judged on, its candidates (the
        residents that transitively depend on ``recalled``), the chunks implied so far."""
        before = self._before_op if self._before_op is not None else self.formed
        states = self._before_states if self._before_op is not None else self._formed_states
        return {"before": before, "states": states, "candidates": self._descendants(recalled, before), "implied": set(),
                "pos": {k: i for i, k in enumerate(self.order)}}

    def _in_cascade(self, run: dict, i: int, d: str, recalled: str, changed: bool) -> bool:
        """Whether ``d`` at index ``i`` is in the cascade (``reconcile``'s ``in_cascade``; noted as
        implied): conditioned on ``recalled`` whose KV now differs from the KV ``d`` was formed on
        (``reconcile`` compares the versions; ``changed``: where ``d``'s states are not known) or
        that now sits behind it, on an implied chunk, or on a candidate that now sits behind it."""
        if d not in run["candidates"]:
            return False
        pos, implied, candidates = run["pos"], run["implied"], run["candidates"]
        formed_on = run["before"].get(d, ())
        states = run["states"].get(d, ())
        for j, a in enumerate(formed_on):
            ia = pos.get(a)
            if ia is None:
                continue
            behind = ia > i
            if a == recalled and not behind and len(states) == len(formed_on):
                changed = states[j] != self._kv_state(a)  # (in front of d: its new KV is settled)
            if (a == recalled and (behind or changed)) or a in implied or (behind and a in candidates):
                implied.add(d)
                return True
        return False

    def _cascade_reform(self, i: int, d: str) -> None:
        """``d`` (at index ``i``) re-formed by the cascade: the eager policy's ``cascade`` decision."""
        if i == 0:  # at the front its canonical is exact: nothing to re-form
            if not (self._simulating and d in self.pending.uncanonical):  # (a provisional one keeps its KV)
                self._set_formed(d, ())
            return
        if self._reforward_prepared(d, self.order[:i]):
            return
        if not self._defers:  # (latency-first: counted when the heal re-forms it)
            self.r.cascade_reforms += 1
        self._cascading = True
        try:
            self.carry_out(d, self.order[:i], self.decide("cascade", d, self.order[:i]), reason="cascade")
        finally:
            self._cascading = False

    def _descendants(self, key: str, formed: dict[str, tuple[str, ...]] | None = None) -> set[str]:
        """Residents that transitively depend on ``key`` (through evicted chunks too: the
        conditioning graph keeps what an evicted chunk was formed on)."""
        out: set[str] = set()
        frontier = [key]
        if formed is None or formed is self.formed:
            formed_of = self._formed_of
        else:
            sets = {d: frozenset(f) for d, f in formed.items()}
            formed_of = sets.__getitem__
        keys = list(self.formed if formed is None else formed)
        while frontier:
            a = frontier.pop()
            for d in keys:
                if d not in out and d != key and a in formed_of(d):
                    out.add(d)
                    frontier.append(d)
        resident = set(self.order)
        return {d for d in out if d in resident}

    def _formed_of(self, key: str) -> frozenset:
        s = self._formed_set.get(key)
        if s is None:
            s = self._formed_set[key] = frozenset(self.formed.get(key, ()))
        return s
