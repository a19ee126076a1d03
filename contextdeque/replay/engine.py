"""Cost-model replay: one trace under one (placement, eviction, reuse arm) combination.

The engine mirrors a ``ContextWindow`` without a model. The window's order comes from the
placement policy; its conditioning follows the default patch policy (an entering chunk gets a
patch on what precedes it — from the store when one was stored on exactly that prefix, else one
conditioned forward; survivors and chunks something was inserted before keep theirs; a reorder
takes an orbit patch where stored, else forms one; a recall whose KV changes re-forms the chunks
conditioned on it: the cascade). Canonicals live in a device pool (byte budget, the eviction
policy), spilling to a host tier (byte budget, LRU) and then to disk; window-resident canonicals
are pinned. Costs come from the calibrated :class:`~.cost.CostModel`.

Everything is deterministic: no clock, no randomness, insertion-ordered containers only.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable, Hashable, Sequence

from ..core.chunk import TEXT_SOURCE_BYTES_PER_TOKEN
from ..core.errors import BudgetError
from ..stores import EvictionPolicy
from ..window.graph import PatchGraph
from ..traces.io import Trace, idle_gaps
from ..window.policy_default import ORBIT_MAX_ANTECEDENTS, ORBIT_MAX_ORDERINGS
from ..patch import PATCH_KINDS
from ..window.policy import make_policy
from ..window.placement import ArrivalPlacement, PlacementPolicy, PlacementView, make_placement
from ..window.pending import PendingWork
from ..window.plan import Difference, Encode, Form, Forward, KeySlot, Load, Op, Plan, Reuse
from .anticipate import AnticipationMirror
from .cascade import CascadeMirror
from .heal import HealMirror
from .cost import CostModel
from .decide import PolicyDecisions, Refs
from .kvstates import KVStateMirror
from .pool import Pool, ReplayConfig, ReplayResult, make_eviction
from .reuse import ReuseCost, make_reuse

__all__ = ["Replayer", "ReplayConfig", "ReplayResult", "Pool"]


class Replayer(PolicyDecisions, KVStateMirror, CascadeMirror, AnticipationMirror, HealMirror):
    """Runs one trace under one policy combination (see the module doc)."""

    def __init__(self, trace: Trace, placement: "str | PlacementPolicy" = "arrival", eviction: "str | EvictionPolicy" = "lru",
                 arm: "str | ReuseCost" = "patch", cost: CostModel | None = None, config: ReplayConfig | None = None,
                 plan: Plan | None = None, idle_tokens: Callable[[float], int] | None = None,
                 factorization_cost: float = 0.0, factorization_fixed: float = 0.0, forward_fixed: float = 0.0,
                 hints: bool = True) -> None:
        self.trace = trace
        #: pass the trace's ``expect`` events on (False: ``replay --ignore-hints``, as the live
        #: window's ``drive_window(hints=False)``)
        self.hints = bool(hints)
        #: the heal budget of a step's idle gap, in prefilled tokens (``replay.live.drive_window``'s
        #: ``idle_tokens``, the same budget the live window heals within); None: heal to completion;
        #: ``factorization_cost`` / ``factorization_fixed``: what that budget charges per token a patch
        #: factorizes and per patch, ``forward_fixed`` per forward beside its tokens (the window's
        #: ``WindowConfig`` fields, ``healing.IdlePrices``)
        self.idle_tokens = idle_tokens
        self.factorization_cost = float(factorization_cost)
        self.factorization_fixed = float(factorization_fixed)
        self.forward_fixed = float(forward_fixed)
        self.factorized_tokens = 0  # tokens of the patches formed or differenced so far (what it charges for)
        self.factorized_patches = 0  # and how many patches
        #: the window operations this replay decides (``window.plan``), recorded when given
        self.plan = plan
        self.placement = make_placement(placement)
        self.eviction = make_eviction(eviction)
        self.arm = make_reuse(arm)
        self.cost = cost or CostModel()
        self.cfg = config or ReplayConfig()
        self.rank = self.cfg.rank if self.cfg.rank is not None else self.cost.rank
        self.kv_bpt = self.cost.kv_bytes_per_token
        self.r = ReplayResult(trace=trace.name, placement=self.placement.name, eviction=self.eviction.name, arm=self.arm.label)
        big = max(trace.chunks.values(), key=lambda a: a.tokens, default=None)
        biggest = big.tokens if big is not None else 0
        if big is not None:
            line = next((i + 2 for i, ev in enumerate(trace.events) if ev.op == "arrive" and ev.id == big.id), None)
            where = f"{trace.path or trace.name}:{line}: chunk {big.id!r}" if line else f"{trace.name}: chunk {big.id!r}"
            if self.cfg.budget_tokens is not None and self.cfg.budget_tokens < biggest:
                raise BudgetError(f"window budget of {self.cfg.budget_tokens} tokens is below one chunk ({where} has {biggest} tokens)")
            if self.cfg.device_bytes < biggest * self.kv_bpt:
                raise BudgetError(f"device budget of {self.cfg.device_bytes} bytes is below one chunk "
                                  f"({where} has {biggest} tokens = {biggest * self.kv_bpt} bytes)")
        self.pool = Pool(self.cfg.device_bytes, self.cfg.host_bytes, self.eviction, self.r, self.do,
                         provisional=lambda key: self.pending.provisional(key))
        self.graph = PatchGraph()
        # the window's own patch policy decides (over key-only slots, ``window.plan.KeySlot``):
        # latency-first rules price its eager policy's decisions and defer them as it does
        self.policy = make_policy(self.arm.window_policy or "eager")
        self.eager = getattr(self.policy, "eager", self.policy)
        # window state
        self.order: list[str] = []
        self.tokens: dict[str, int] = {cid: a.tokens for cid, a in trace.chunks.items()}
        self.content: dict[str, str] = {cid: a.hash for cid, a in trace.chunks.items()}
        self._refs = Refs(self.content, self.tokens)
        self._key_by_content: dict[str, str] | None = None  # (built when a placement first asks)
        self._key_slots: dict[str, tuple[tuple[str, ...], KeySlot]] = {}
        self.formed: dict[str, tuple[str, ...]] = {}
        self._init_kv_states()  # (replay.kvstates: the live window's KV states, mirrored)
        self._formed_set: dict[str, frozenset] = {}  # lazily built membership sets of `formed`
        self.window_tokens = 0
        self._fast = type(self.placement) is ArrivalPlacement
        self._upkeep = getattr(self.placement, "upkeep", None)
        self._next_ref: dict[str, list[int]] | None = None
        self.on_step: Any = None  # called at every step boundary (plots tap the running totals)
        # the agent's own order (what `slide` and `at` refer to), beside the placed order
        self.logical: list[str] = []
        # latency-first (an arm with ``defers``): new content is one forward after the window now
        # (provisional: no canonical yet), conditioning that needs a forward waits for the heal at
        # the next step boundary (the agent's tool time), which then does what the eager policy
        # would on the window as it stands
        self._defers = bool(getattr(self.arm, "defers", False))
        self._healing = False
        self._recalling = False
        self._entering: frozenset[str] = frozenset()  # the chunks the current admission brings in
        # what the heal owes each chunk key (``window.pending``: the record the live window keeps
        # too): conditioning queued, entering / forwarded / uncanonical chunks (no canonical yet; a
        # healed one whose forward the eager policy would keep waits until something re-reads it
        # elsewhere), canonicals owed at the front, by chunks that left (``patch-latency-shared``:
        # the heal computes every canonical, also of chunks that left before it) and by evicted ones
        self.pending: PendingWork[str] = PendingWork()
        self._lazy = self.arm.lazy_canonicals
        self._cascading = False
        self._before_op: dict[str, tuple[str, ...]] | None = None  # ``formed`` before a recall (its cascade)
        self._before_states: dict[str, tuple[str, ...]] | None = None  # ... and the KV states it was formed on
        self._left: list[str] = []  # what the budget's slide let go in the current admission
        # residents the current admission decided on with more than a plain keep (a store lookup, a
        # form, a deferral): the recall cascade does not re-decide them (``reconcile``)
        self._not_kept: set[str] = set()
        # idle-time anticipation (replay.anticipate), for rules that price a window policy
        self._init_anticipation(bool(self.cfg.anticipate and self.arm.window_policy), self.cfg.recall_predictor)

    # ------------------------------------------------------------------ charges
    def do(self, op: Op, *, window_op: bool = True) -> None:
        """Charge one planned operation: what it counts (``window.plan``: the counts the live
        window's receipts add up) and its modelled seconds (``CostModel.seconds``). ``window_op``:
        part of the window's plan (False: a query's own read or an arm's recompute)."""
        r = self.r
        counts = op.counts()
        if counts.get("tokens_prefilled"):  # (a forward in between: the next re-forward runs a forward of its own)
            self._open_run = None
        if counts:
            r.forwards += counts.get("forwards", 0)
            r.tokens_prefilled += counts.get("tokens_prefilled", 0)
            r.encodes += counts.get("encodes", 0)
            r.patch_forms += counts.get("patches_formed", 0)
            r.patch_hits += counts.get("patches_reused", 0)
        if isinstance(op, (Form, Difference)):
            self.factorized_tokens += op.tokens
            self.factorized_patches += 1
        stored = op.stored()
        if stored is not None and stored[1]:
            r.stored[stored[0]] = r.stored.get(stored[0], 0) + stored[1]
        seconds = self.cost.seconds(op)
        r.est_seconds += seconds
        if isinstance(op, Load):
            r.load_seconds += seconds
        if window_op and self.plan is not None:
            self.plan.add(op)

    def charge_apply(self, tokens: int) -> None:
        """Relocate (+ patch) ``tokens`` of canonical KV into the pages a query reads."""
        if tokens > 0:
            self.r.est_seconds += tokens * self.kv_bpt / self.cost.apply_bytes_per_s

    def _form(self, key: str, prefix: Sequence[str], kind: str = "exact", ctx: int | None = None, max_orderings: int = 1,
              reason: str | None = None) -> None:
        """Conditioning for ``key`` behind ``prefix`` (``ctx``: its tokens, when the caller knows
        them): a store hit or one formed patch (latency-first: the provisional forward, or deferred
        to the heal, which decides on the first deferral's ``reason``); an orbit patch runs one
        forward per ordering, at most ``max_orderings``."""
        pc = tuple(map(self.content.__getitem__, prefix))
        c = self.content[key]
        r = self.r
        if self._healing and key in self.pending.uncanonical:
            # no canonical to patch: one conditioned forward behind this prefix, and still none (a
            # stored patch would cost as much: the canonical's forward)
            t = self.tokens[key]
            r.patch_forms += 1  # (the replay counts the re-forward among its forms)
            self.do(Forward(c, t, context=sum(map(self.tokens.__getitem__, prefix)) if ctx is None else ctx))
            self._set_formed(key, tuple(prefix), "inline")
            return
        # (a removal patch is a correction stacked on this slot's own patches: never a store hit)
        hit = self._stored(key, prefix, kind)
        if hit:
            self.do(Reuse(c, self.tokens[key], kind=kind, antecedents=pc))
            self._read_patch(key, prefix, kind)
        elif self._defers and not self._healing:
            if key in self.pending.entering and PATCH_KINDS[kind].exact_on_prefix:
                # new content: one forward of its tokens after the window (a prefix cache's append);
                # its KV is exactly conditioned on this prefix, the canonical and patch come at heal
                t = self.tokens[key]
                if ctx is None:
                    ctx = sum(map(self.tokens.__getitem__, prefix))
                self.do(Forward(c, t, context=ctx))
                self.pending.forward(key, pc)
            else:  # no forward on the critical path: it keeps what it has until the heal
                self.pending.defer(key, reason, self._cascading)
                self._stand_in(key, prefix)
                if self._recalling and not self._cascading and tuple(prefix) != self.formed.get(key, ()):
                    # its KV will change at the heal: the chunks conditioned on it now re-form then
                    # (the recall cascade, decided at the recall as the eager policy does)
                    for d in self.dependents(key):
                        if d != key:
                            self.pending.defer(d, cascade=True)
                return
        else:
            t = self.tokens[key]
            if ctx is None:
                ctx = sum(map(self.tokens.__getitem__, prefix))
            n_fw = min(math.factorial(len(prefix)), max_orderings) if kind == "orbit" else 1
            pb = self.cost.patch_bytes(t, self.rank)
            tier = self.pool.write(self._patch_key(key, prefix, kind), pb)
            self.do(Form(c, t, kind=kind, antecedents=pc, forwards=n_fw, context=ctx, tier=tier, nbytes=pb))
            r.patch_bytes += pb
            if kind != "removal":
                self.graph.add(c, pc, kind)
                self._store(key, prefix, kind)
        provisional = self._defers and key in self.pending.forwarded or (self._healing and key in self.pending.uncanonical)
        self._set_formed(key, tuple(prefix), "inline" if provisional else kind)

    def _prefix_content(self, key: str) -> tuple[str, ...]:
        i = self.order.index(key)
        return tuple(self.content[p] for p in self.order[:i])

    def _enter(self, key: str) -> None:
        """A chunk enters the window: its canonical from the pool (or encoded)."""
        self.window_tokens += self.tokens[key]
        if not self.arm.canonicals:
            return
        c = self.content[key]
        pool = self.pool
        t = self.tokens[key]
        if not self._healing and self.pending.take_departed(key):  # left before the heal computed its canonical: now
            pool.access(("c", c), self._entry_bytes(t), store=False)
            self._encode(key)
        elif pool.access(("c", c), self._entry_bytes(t), store=False) is None:
            if self._defers and not self._healing:
                self.pending.enter(key)  # its forward comes with its conditioning (_form)
                pool.hold(("c", c), key)
                return
            self._encode(key)
        pool.hold(("c", c), key)  # resident in the window (held: demoted when no window holds it)

    def _encode(self, key: str) -> None:
        """One forward of ``key``'s tokens alone: its canonical, stored and read back (as the
        window's ``encode_and_store``)."""
        t = self.tokens[key]
        nbytes = self.arm.canonical_bytes(t, self.kv_bpt)
        tier = self.pool.write(("c", self.content[key]), self._entry_bytes(t), read_back=True) if self.arm.canonicals else "device"
        self.do(Encode(self.content[key], t, tier=tier, nbytes=nbytes))

    def _entry_bytes(self, tokens: int) -> int:
        """A canonical's store entry: its KV at rest (the arm's) and its source (token ids and
        positions, as a text chunk's entry keeps them: ``core.chunk.TEXT_SOURCE_BYTES_PER_TOKEN``)."""
        return self.arm.canonical_bytes(tokens, self.kv_bpt) + tokens * TEXT_SOURCE_BYTES_PER_TOKEN

    def _read_patch(self, key: str, prefix: Sequence[str], kind: str) -> None:
        """A store hit on ``key``'s stored patch of ``kind`` on ``prefix`` (promoted; no ``Load``)."""
        self.pool.access(self._patch_key(key, prefix, kind), self.cost.patch_bytes(self.tokens[key], self.rank),
                         store=False, load=False)

    def _patch_key(self, key: str, prefix: Sequence[str], kind: str) -> tuple:
        """The store key of ``key``'s patch of ``kind`` on ``prefix`` in its KV states now (as
        ``_store`` records it: the live window keys a patch by its antecedents' KV states)."""
        kind = "exact" if kind == "recall" else kind
        states = self._antecedent_states(prefix, kind)  # (an orbit patch's: a set, named in sorted order)
        return ("p", self.content[key], kind, repr(sorted(map(repr, states)) if isinstance(states, frozenset) else states))


    # ------------------------------------------------------------------ operations
    def view(self, index: int, entering: Sequence[str] = ()) -> PlacementView:
        """What the placement sees (``placement.window_index``): the residents and the ``entering``
        chunks (their tokens: an antecedent that left counts for no staleness, as in the window)."""
        order = self.order
        tokens = {k: self.tokens[k] for k in (*order, *entering)}
        return PlacementView(
            order=list(order), tokens=tokens, content=self.content, formed_on=self._carried(order, entering),
            has_patch=self._has_valid_patch(order) if self.arm.patches else (lambda c, p: False),
            has_orbit=self.graph.has_orbit if self.arm.patches else (lambda c, s: False),
            stored_prefixes=self.graph.stored_prefixes if self.arm.patches else (lambda c: ()),
            dependents=self.dependents if self.arm.patches else (lambda k: []),
            may_hit=self.graph.may_hit, conditioning=self.arm.patches,
            budget_tokens=self.cfg.budget_tokens, patch_policy=self.policy,
            future=_FutureView(self._next_ref, index, self._ops) if self._next_ref is not None else None,
        )

    def _carried(self, order: Sequence[str], entering: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """``view.formed_on`` as the window gives it: what each resident's KV is conditioned on now
        (a blind stand-in or a canonical: nothing), and for an entering chunk what it carried."""
        out = {k: self.formed.get(k, ()) if k in self._state else () for k in order}
        out.update((k, self.formed.get(k, ())) for k in entering)
        return out

    def _has_valid_patch(self, order: Sequence[str]):
        """``view.has_patch`` as the window answers it (``placement.window_index``): whether the store
        holds an exact patch of the content on that prefix of residents *in their KV states now*
        (a patch formed on the same contents in other states serves nothing)."""
        resident = {self.content[k]: k for k in order}
        if self._key_by_content is None:
            self._key_by_content = {c: k for k, c in self.content.items()}
        any_key = self._key_by_content

        def has_patch(content: str, prefix: tuple[str, ...]) -> bool:
            keys = [resident.get(c) for c in prefix]
            return content in any_key and None not in keys and self._is_stored(any_key[content], keys, "exact")
        return has_patch

    def _remove(self, key: str, index: int = -1) -> None:
        before = self.order
        i = before.index(key)
        self.order = before[:i] + before[i + 1:]
        if key in self.logical:
            self.logical.remove(key)
        self.evicted.pop(key, None)
        self.evicted[key] = None  # (eviction order: the last one left most recently)
        self._changed()
        self._leave(key)
        if i == 0 and self.order and self.order[0] in self.pending.uncanonical:
            self.pending.owe_canonical(self.order[0])
        elif i == 0 and self.order and self.arm.patches and self.formed.get(self.order[0]):
            self._set_formed(self.order[0], ())  # a survivor at the front drops its patches: the canonical
        if not self.arm.patches or i >= len(self.order):
            return
        if self._upkeep is None or self._simulating:  # survivors behind the departed chunk: what the patch policy says
            order = self.order
            for j in range(i, len(order)):
                k = order[j]
                if j == 0 and self.pending.unencoded(k):
                    continue  # no canonical to clear to (the window's provisional slot): the heal computes it
                d = self.decide("survivor", k, order, j)
                if d.action == "keep":  # (the common answer: nothing to price)
                    self.r.stale_keeps += bool(self.formed.get(k))
                    continue
                if not d.may_keep:  # (the recall cascade does not re-decide it: ``reconcile``)
                    self._not_kept.add(k)
                if self.carry_out(k, order[:j], d) == "keep" and self.formed.get(k):
                    self.r.stale_keeps += 1
            return
        view = self.view(index)  # survivors behind the departed chunk: keep, clear or refresh
        for j in range(i, len(self.order)):
            self._resident_upkeep(view, self.order[j], self.order[:j], before[:j + 1])

    def _resident_upkeep(self, view: PlacementView, key: str, prefix: list[str], before: list[str],
                         cascade: bool = False) -> None:
        """A resident whose prefix changed: the placement policy's upkeep decision (the scheduler's
        staleness rule), else keep (the default patch policy: survivors keep their KV)."""
        r = self.r
        if self._upkeep is None or self._simulating:  # the patch policy's answer for a resident something was inserted before
            d = self.decide("inserted", key, prefix)
            if cascade and d.may_keep:  # in the recall's cascade: re-formed instead (``reconcile``)
                self._cascade_reform(len(prefix), key)
                return
            if self.carry_out(key, prefix, d) == "keep":
                r.stale_keeps += 1
            return
        action = self._upkeep(view, key, prefix, before)
        if action == "keep" and cascade:
            self._cascade_reform(len(prefix), key)
        elif action == "keep":
            r.stale_keeps += 1
        elif action == "clear":
            if key in self.pending.uncanonical:
                self.pending.owe_canonical(key)
            else:
                self._set_formed(key, ())
        elif action == "refresh-hit" and key in self.pending.uncanonical:  # the stored patch needs its canonical: at heal
            r.refreshes += 1
            self.pending.requeue(key)
        elif action == "refresh-hit":
            self.do(Reuse(self.content[key], self.tokens[key], antecedents=tuple(self.content[p] for p in prefix)))
            self._read_patch(key, prefix, "exact")
            r.refreshes += 1
            self._set_formed(key, tuple(prefix))  # (the placement's view judged the hit: see view())
        else:  # "refresh" / "removal": one conditioned forward
            r.refreshes += 1
            self._form(key, prefix, "removal" if action == "removal" else "exact")

    def _admit(self, index: int, entering: list[tuple[str, int | None]], recall: bool) -> None:
        est0, load0 = self.r.est_seconds, self.r.load_seconds
        self._open_run = None  # (the window's re-forwards join within one reconcile pass)
        try:
            self._recalling, self._entering = recall, frozenset(k for k, _ in entering)
            # the conditioning before the operation: what the recall cascade is judged on (the
            # window's reconcile reads each slot's conditioning as it was, before the budget's slide
            # dropped a front survivor's patches)
            self._before_op = dict(self.formed) if recall else None
            self._before_states = dict(self._formed_states) if recall else None
            self._left, self._not_kept = [], set()
            for k, _ in entering:
                self.evicted.pop(k, None)
                self.pending.clear_owed(k)
            self._changed()
            self._admit_inner(index, entering, recall)
            for k in self.pending.take_entering():  # at the front or a store hit: its canonical is needed now
                self._encode(k)
        finally:
            self._recalling, self._entering = False, frozenset()
            self._before_op = self._before_states = None
            if self.cfg.overlap_loads:
                # loads ran beside this admission's model work: it costs the longer of the two
                load = self.r.load_seconds - load0
                compute = self.r.est_seconds - est0 - load
                saved = min(load, max(0.0, compute))
                self.r.est_seconds -= saved
                self.r.overlap_saved_seconds += saved

    def _admit_inner(self, index: int, entering: list[tuple[str, int | None]], recall: bool) -> None:
        need = sum(self.tokens[k] for k, _ in entering)
        budget = self.cfg.budget_tokens
        if budget is not None and self.window_tokens + need > budget:
            for k in self.placement.make_room(self.view(index), need):
                if k in self.order:
                    self._remove(k, index)
                    self._left.append(k)
                    self.r.window_evictions += 1
        # arrival order, a simulated recall (anticipation places it where the prediction says, as
        # ``anticipation.simulate_recall`` does), or a provisional chunk: the placement is not asked
        direct = self._fast or self._simulating or self._enters_provisional(entering, recall)
        if direct and entering[0][1] is None:
            # arrival order at the end: only the entering chunk is looked at
            key = entering[0][0]
            self._enter(key)
            self.order.append(key)
            if self.arm.patches:
                if recall:  # (in window order: the residents it implies, all in front of it, first)
                    self._cascade(key, True, {key}, hi=len(self.order) - 1)
                prefix = self.order[:-1]
                if prefix:
                    why = "recall" if recall else "append"
                    self.carry_out(key, prefix, self.decide(why, key, prefix), ctx=self.window_tokens - self.tokens[key], reason=why)
                else:
                    self._set_formed(key, ())
            return
        if direct:
            key, at = entering[0]
            # the asked index in the window before the budget's slide (``ContextWindow.recall``)
            pos = max(0, min(at, len(self.order) + len(self._left)) - len(self._left))
            new_order = self.order[:pos] + [key] + self.order[pos:]
        else:  # (a trace's recall without an index is pinned at the end, as the trace executor asks it)
            new_order = self.placement.place(self.view(index, [k for k, _ in entering]),
                                             [(k, len(self.order) if recall and a is None else a) for k, a in entering])
        old_order = self.order
        old_pos = {k: i for i, k in enumerate(old_order)}
        ent = {k for k, _ in entering}
        for k in ent:
            self._enter(k)
        self.order = new_order
        if not self.arm.patches:
            return
        view = self.view(index) if self._upkeep is not None else None
        # reconcile: entering chunks get conditioning; residents behind an insertion keep theirs
        # (or, under the scheduler, whatever its staleness rule decides)
        changed: dict[str, bool] = {}
        recalled = next(iter(ent)) if recall and len(ent) == 1 else None
        run = self._cascade_run(recalled) if recalled is not None else None
        for i, k in enumerate(new_order):
            # the cascade, slot by slot in window order as ``reconcile`` runs it (a slot in front of
            # the recalled chunk is implied whatever its KV: the recalled chunk sits behind it)
            member = run is not None and self._in_cascade(run, i, k, recalled, changed.get(recalled, True))
            if k in ent:
                prefix = new_order[:i]
                before = self.formed.get(k, ())
                if not prefix:
                    self._set_formed(k, ())
                else:
                    why = "recall" if recall else "append"
                    self.carry_out(k, prefix, self.decide(why, k, prefix), reason=why)
                if recall:
                    changed[k] = self.formed[k] != before
            elif old_pos.get(k, -1) != i:
                self._resident_upkeep(view, k, new_order[:i], old_order[:old_pos[k]], cascade=member)
            elif member and k not in self._not_kept:  # (its own decision: a keep)
                self._cascade_reform(i, k)

    def _enters_provisional(self, entering: list[tuple[str, int | None]], recall: bool) -> bool:
        """Whether the one entering chunk comes in provisional: a latency-first window's append, or
        recall (lazy canonicals, not to the front) of a chunk that left before it was healed, with
        no canonical stored; one forward behind the window where it was asked, which the window
        places without asking its placement (``placement.window_index``, ``ContextWindow.recall``)."""
        if not (self._defers and self.arm.canonicals) or self._healing or len(entering) != 1 or not self.order:
            return False
        key, at = entering[0]
        if key in self.pending.departed or self.pool.contains(("c", self.content[key])):
            return False
        if not recall:
            return True
        pos = len(self.order) if at is None else max(0, min(at, len(self.order) + len(self._left)) - len(self._left))
        return self._lazy and pos > 0

    def _reorder(self, order: list[str]) -> None:
        resident = set(self.order)
        present = [k for k in order if k in resident]
        named = set(present)
        rest = [k for k in self.order if k not in named]
        new_order = present + rest
        old = self.order
        self.order = new_order
        self.note_reorder(old, new_order)  # (reorder anticipation learns from these)
        if not self.arm.patches:
            if new_order != old:
                self._changed()
            return
        # a reorder that changes no slot leaves the window as it was, its deferrals included
        # (``window._same_state``: nothing is installed, so nothing is queued)
        before = (dict(self.formed), dict(self._state), self.pending.copy())
        self._reorder_slots(new_order)
        if new_order == old and before[:2] == (self.formed, self._state):
            self.pending.restore_queue(before[2])
        else:
            self._changed()

    def _reorder_slots(self, new_order: list[str]) -> None:
        self._open_run = None  # (the window's re-forwards join within one reconcile pass)
        for i, k in enumerate(new_order):
            prefix = new_order[:i]
            if self.valid(k, prefix):
                continue  # (valid: the policy keeps it; a slot that did not move but carries stale
                # conditioning is decided like any other, as ``window.reorder`` asks about every slot)
            if not prefix:
                if k in self.pending.uncanonical:
                    self.pending.owe_canonical(k)
                else:
                    self._set_formed(k, ())
                continue
            if k in self.pending.uncanonical:  # no canonical for a stored patch to serve: re-forwarded at the heal
                if not self._reforward_prepared(k, prefix) and not self._simulating:  # (prepared, or
                    self._form(k, prefix, reason="reorder")  # anticipation keeps it: ``HealPolicy``)
                continue
            self.carry_out(k, prefix, self.decide("reorder", k, prefix), reason="reorder")

    def run(self) -> ReplayResult:
        """Replay the whole trace; returns the result (the engine is single-use)."""
        if self.eviction.offline:
            self.eviction.prepare(_access_log(self))
        self._prepare_future()
        self._run()
        self.pool.settle()
        return self.r

    def _prepare_future(self) -> None:
        if not getattr(self.placement, "offline", False):
            return
        refs: dict[str, list[int]] = {}
        for i, ev in enumerate(self.trace.events):
            for k in _named(ev):
                refs.setdefault(k, []).append(i)
        self._next_ref = refs
        self._ops = [ev.op for ev in self.trace.events]

    def _run(self) -> None:
        r = self.r
        cost = self.cost
        gaps = idle_gaps(self.trace) if self.idle_tokens is not None else {}
        stack: list[tuple] = []
        for idx, ev in enumerate(self.trace.events):
            r.events += 1
            op = ev.op
            if op == "arrive" or op == "recall":
                if ev.id in self.order:
                    continue
                self.logical.insert(len(self.logical) if ev.at is None else min(ev.at, len(self.logical)), ev.id)
                self._admit(idx, [(ev.id, ev.at)], op == "recall")
                self._observe("recall" if op == "recall" else "append", (ev.id,), self._left)
            elif op == "query":
                r.queries += 1
                self.arm.query(self, ev.tokens, ev.output_tokens)
                self.do(Forward("query", ev.tokens, context=self.window_tokens), window_op=False)
                r.est_seconds += ev.output_tokens / cost.decode_tokens_per_s
            elif op == "evict":
                if ev.id in self.order:
                    self._remove(ev.id, idx)  # survivors keep their KV (relocation only) unless the placement refreshes them
                    self._observe("evict", (ev.id,), (ev.id,))
            elif op == "slide":  # the agent's n oldest, wherever placement put them
                for k in self.logical[: ev.n]:
                    self._remove(k, idx)
                    self.pool.install(self.order)  # (one window operation per chunk)
                    self._observe("evict", (k,), (k,))
            elif op == "reorder":
                self.logical = [k for k in ev.order if k in set(self.order)]
                self._reorder(list(ev.order))
                self._observe("reorder", self.order)
            elif op == "expect" and not self.hints:
                pass  # the agent's hints are not passed on
            elif op == "expect" and getattr(ev, "order", None) is not None:
                self.expect_order(ev.order)
            elif op == "expect":
                self.expect(ev.id, ev.at)
            elif op == "step":
                r.steps += 1
                if self.idle_tokens is not None:  # the idle gap the trace records, as the window spends it
                    self._idle_step(int(self.idle_tokens(gaps[idx])))
                elif self._has_pending() or self.anticipation_due:  # the agent's idle time
                    self.heal()
                    self.anticipate()
                if self.on_step is not None:
                    self.on_step()
            elif op == "fork":
                stack.append((list(self.order), list(self.logical), dict(self.formed), self.window_tokens,
                              self.pool.fork(self.order), self.pending.copy(), dict(self._state), dict(self._formed_states),
                              dict(self.evicted), self._fork_anticipation()))
                self._observe("fork", self.order)
                self._observe("fork", self.order)  # (recorded by the parent and by the fork)
            elif op == "commit":
                committed = stack.pop()
                self.pool.end_fork(committed[4], committed=True, order=self.order, parent_order=committed[0])
                self._end_fork_anticipation(committed[-1], committed=True)
                self._observe("commit", self.order)
                self._observe("commit", self.order)
            elif op == "discard":
                fork_order = list(self.order)
                self._observe("discard", self.order)
                order, logical, formed, wt, pinned, pending, states, formed_states, evicted, anticipation = stack.pop()
                self.evicted = evicted
                self._end_fork_anticipation(anticipation, committed=False)
                self._state, self._formed_states = states, formed_states  # the parent's KV states as they were
                # the parent's queued work as it was, less the canonicals the fork computed (they stay
                # stored); what the fork forwarded stays queued so the heal knows its canonical is never made
                self.pending.discard_fork(pending, self.order)
                self.order, self.logical, self.formed, self.window_tokens = order, logical, formed, wt
                self._formed_set = {}
                self.pool.end_fork(pinned, committed=False, order=fork_order, parent_order=order)
            self.pool.install(self.order)  # the event's window operation ends
        if self._has_pending():  # what is still queued when the trace ends is healed in the idle after it
            self.heal()
            self.anticipate()
        self.pool.install(self.order)
        sched = getattr(self.placement, "decisions", None)
        if sched:
            r.scheduler = dict(sched)


class _FutureView(dict):
    """``key -> index of the next event naming it`` after ``index`` (None: never); ``next_op(key)``
    names that event's op."""

    def __init__(self, refs: dict[str, list[int]], index: int, ops: Sequence[str] = ()) -> None:
        super().__init__()
        self._refs, self._index, self._ops = refs, index, ops

    def next_op(self, key) -> str | None:
        i = self.get(key)
        return self._ops[i] if i is not None and i < len(self._ops) else None

    def get(self, key, default=None):  # type: ignore[override]
        import bisect

        lst = self._refs.get(key)
        if not lst:
            return default
        j = bisect.bisect_right(lst, self._index)
        return lst[j] if j < len(lst) else default


def _named(ev: Any) -> list[str]:
    if ev.op in ("arrive", "recall", "evict"):
        return [ev.id]
    if ev.op == "reorder":
        return list(ev.order)
    return []


def _access_log(eng: Replayer) -> list[str]:
    """The pool's access sequence for this trace, placement and arm (it does not depend on the
    eviction policy: what is read is decided by the trace and the placement)."""
    probe = Replayer(eng.trace, type(eng.placement)(), "lru", eng.arm.copy(), eng.cost, eng.cfg,
                     idle_tokens=eng.idle_tokens, factorization_cost=eng.factorization_cost,
                     factorization_fixed=eng.factorization_fixed, forward_fixed=eng.forward_fixed, hints=eng.hints)
    probe.pool.log = []
    probe._prepare_future()
    probe._run()
    return probe.pool.log

