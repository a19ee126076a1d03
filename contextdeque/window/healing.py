"""Healing a latency-first window: the conditioning its policy deferred, carried out later (``heal``,
the idle healer), each step one transaction on the window as it then stands."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, Generic, Hashable, Iterable, Sequence, TypeVar

from ..core.args import check_float, check_int
from ..core.errors import WindowError, WindowTypeError
from ..patch import form_patch
from . import ingest
from .pending import HealNeed, heal_need
from .plan import Difference, Form
from .policy import PatchPolicy
from .policy_latency import HealPolicy
from .receipt import Meter, Receipt
from .reconcile import patch_store_key, reconcile
from .ref import ChunkRef
from .slot import Slot
from .staleness import staleness
from .state import WindowState

if TYPE_CHECKING:  # pragma: no cover
    from .healer import Healer


K = TypeVar("K", bound=Hashable)


def heal_batch(order: Sequence[K], pending: Collection[K], priority: Callable[[K], float],
               target: K | None = None) -> list[K]:
    """``heal()``'s order of work, over keys (the window's refs, the replay's chunk ids): the next
    step heals the pending chunk of highest ``priority`` (``target`` instead, when it is pending;
    of equal ones the frontmost) together with the pending chunks in front of it (a patch is
    formed on its antecedents' current KV, so they go first), in window ``order``. Empty: nothing
    pending."""
    queued = [k for k in order if k in pending]
    if not queued:
        return []
    chosen = target if target is not None and target in queued else max(queued, key=priority)
    return queued[: queued.index(chosen) + 1]


@dataclass(frozen=True)
class HealTask(Generic[K]):
    """One chunk's work in a heal step, over keys: ``need`` (:data:`HealNeed`) of ``key``, which
    stands behind ``prefix`` (the keys in front of it now; what a difference or re-forward is
    taken on)."""

    key: K
    need: HealNeed
    prefix: tuple[K, ...] = ()


def plan_heal_step(order: Sequence[K], pending: Collection[K], priority: Callable[[K], float],
                   need_of: Callable[[K, int], HealNeed], departed: Sequence[K] = (),
                   target: K | None = None) -> list[HealTask[K]]:
    """One heal step over keys, the plan both executors follow (the window runs it, the replay
    prices it): the batch of :func:`heal_batch` in window ``order``, each chunk with what it needs
    (``need_of(key, index)``, :func:`heal_need`); with nothing ``pending``, the canonical of the
    first chunk of ``departed`` (those that left before theirs was computed, in eviction order).
    Empty: nothing to do."""
    batch = heal_batch(order, pending, priority, target)
    if not batch:
        return [HealTask(departed[0], "departed")] if departed else []
    index = {k: i for i, k in enumerate(order)}
    return [HealTask(k, need_of(k, index[k]), tuple(order[: index[k]])) for k in batch]


def idle_spent(receipts: Iterable[Receipt], factorization_cost: float, factorization_fixed: float = 0.0,
               forward_fixed: float = 0.0) -> float:
    """What ``receipts`` (heal and anticipation steps) cost a heal's token budget
    (``heal(max_tokens=...)``) at these prices (``WindowConfig.forward_fixed`` /
    ``factorization_fixed`` / ``factorization_cost``): :meth:`IdlePrices.spent`."""
    return IdlePrices(factorization_cost, factorization_fixed, forward_fixed).spent(receipts)


def factorization_charge(tokens: int, patches: int, factorization_cost: float, factorization_fixed: float) -> float:
    """What factorizing ``patches`` patches of ``tokens`` tokens in all costs an idle budget, in
    prefill tokens: ``factorization_fixed`` per patch (one top-m factorization over all layers,
    whose cost does not grow with the chunk) plus ``factorization_cost`` per token."""
    return factorization_fixed * patches + factorization_cost * tokens


@dataclass(frozen=True)
class IdlePrices:
    """What idle-time work costs a heal's token budget, in prefill tokens (the window's
    ``WindowConfig`` charges; ``replay --idle-rate`` sets them from the cost model,
    ``replay.fidelity.idle_charges``): a forward its tokens plus ``forward_fixed`` (a forward's
    fixed part, ``CostModel.forward_fixed_s``, which no rate scales away), a factorized patch
    ``factorization_fixed`` plus ``factorization_cost`` per token. The one price list of the
    budget (:class:`HealBudget`, :func:`idle_spent`) and of anticipation's estimates
    (``window.anticipation``), the window's and the replay's alike."""

    factorization_cost: float = 0.0
    factorization_fixed: float = 0.0
    forward_fixed: float = 0.0

    def charge(self, tokens: float, forwards: int, factorized: float = 0, patches: int = 0) -> float:
        """``forwards`` forwards prefilling ``tokens`` tokens in all, and ``patches`` patches
        factorizing ``factorized`` tokens in all."""
        return (tokens + self.forward_fixed * forwards
                + factorization_charge(factorized, patches, self.factorization_cost, self.factorization_fixed))

    def spent(self, receipts: Iterable[Receipt]) -> float:
        """What ``receipts`` (heal and anticipation steps) cost: :meth:`charge` of the tokens their
        forwards prefilled, their forwards, and the patches they factorized with those patches'
        tokens (a ``Form``'s factorization, once whatever its forwards, or a ``Difference`` taken
        from a forward already run)."""
        spent = 0.0
        for r in receipts:
            sizes = [op.tokens for op in r.plan if isinstance(op, (Form, Difference))]
            spent += self.charge(r.tokens_prefilled, r.forwards, sum(sizes), len(sizes))
        return spent


@dataclass
class HealBudget:
    """What one ``heal()`` may spend, checked between its steps (each a whole transaction): at
    most ``max_steps`` steps, ``max_tokens`` prefilled tokens (a deterministic idle budget: the
    trace executor's idle gaps), until ``deadline`` (``time.perf_counter()``; the live window's
    only). The heal's queued work and then anticipation's preparations draw on the same budget;
    the window executes the steps, the replay prices them, both under this one rule. A step costs
    what ``prices`` charges its forwards and factorizations (:class:`IdlePrices`: ``forward_fixed``
    per forward beside its tokens; ``factorization_fixed`` per patch and ``factorization_cost`` per
    token)."""

    max_steps: int | None = None
    max_tokens: int | None = None
    deadline: float | None = None
    prices: IdlePrices = IdlePrices()
    steps: int = 0
    tokens: float = 0.0

    @property
    def bounded(self) -> bool:
        """Whether a budget other than the step count applies (anticipation then ranks by cost)."""
        return self.max_tokens is not None or self.deadline is not None

    def timed_out(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def allows_step(self) -> bool:
        """Whether another heal step may start."""
        if self.max_steps is not None and self.steps >= self.max_steps:
            return False
        return not self.timed_out() and (self.max_tokens is None or self.tokens < self.max_tokens)

    def fits(self, cost_tokens: int | None) -> bool:
        """Whether a preparation estimated at ``cost_tokens`` (None: not priced) fits what is left."""
        return self.max_tokens is None or (self.tokens < self.max_tokens and self.tokens + (cost_tokens or 0) <= self.max_tokens)

    def spend(self, tokens: int, factorized: int = 0, patches: int = 0, forwards: int = 0) -> None:
        """One step done, which ran ``forwards`` forwards prefilling ``tokens`` and factorized
        ``patches`` patches of ``factorized`` tokens in all."""
        self.steps += 1
        self.tokens += self.prices.charge(tokens, forwards, factorized, patches)

    def spend_receipt(self, receipt: Receipt) -> None:
        """One step done, as its receipt says (:meth:`IdlePrices.spent`)."""
        self.steps += 1
        self.tokens += self.prices.spent((receipt,))


class WindowHealing:
    """The healing operations of a :class:`~.window.ContextWindow` (a mixin over its ``_run``)."""

    # ------------------------------------------------------------------ healing
    @property
    def pending_refs(self) -> tuple[ChunkRef, ...]:
        """In-window chunks a latency-first policy answered with a stale or blind patch, in window
        order: what :meth:`heal` would work on."""
        return tuple(s.ref for s in self._state.slots if s.ref in self._state.pending)

    def heal_priority(self, ref: ChunkRef) -> float:
        """How urgently ``ref`` needs healing: its staleness x its expected reuse."""
        idx = self._state.index(ref)
        slots = self._state.slots
        reuse = self._ctx.expected_reuse(ref) if self._ctx.expected_reuse is not None else 1.0
        return staleness(slots[idx], slots[:idx]) * float(reuse)

    def heal(self, max_ms: float | None = None, *, max_steps: int | None = None, max_tokens: int | None = None,
             anticipate: bool = True) -> Receipt:
        """Carry out the conditioning a latency-first policy deferred, most urgent first.

        Each step takes the pending chunk of highest :meth:`heal_priority` (the frontmost of equal
        ones) and heals it together with the pending chunks in front of it (:func:`heal_batch`:
        a patch is formed on its antecedents' current KV, so they go first), running the eager
        policy's decisions on the window as it stands;
        each step is one transaction (an error or interruption leaves the window as it was
        before that step). Stops when nothing is pending, after ``max_steps`` steps, or once
        ``max_ms`` have passed, or once the forwards have prefilled ``max_tokens`` tokens (checked
        between steps: a deterministic idle budget, where ``max_ms`` depends on the machine;
        :class:`HealBudget`, the rule the replay prices an idle gap with). With
        ``anticipate=True``, what is left of the budget then prepares the next likely re-reads,
        the recall predictor's best by expected benefit per token (``window.anticipation``;
        ``max_tokens=0``: nothing; ``anticipate=False``: only the queued work, what the eager policy
        owes the window as it stands). Returns one receipt for all steps
        (``op="heal"``; each step is also in ``receipts``). Under an eager policy nothing is
        ever pending and this is a no-op.
        """
        self._check_open()
        check_float("max_ms", max_ms, minimum=0.0, none_ok=True, error=WindowError)
        check_int("max_steps", max_steps, minimum=0, none_ok=True, error=WindowError)
        check_int("max_tokens", max_tokens, minimum=0, none_ok=True, error=WindowError)
        if not isinstance(anticipate, bool):
            raise WindowTypeError(f"anticipate must be a bool, got {type(anticipate).__name__}")
        from .anticipation import idle_prices  # (anticipation builds on this module)

        t0 = time.perf_counter()
        budget = HealBudget(None if max_steps is None else int(max_steps), None if max_tokens is None else int(max_tokens),
                            None if max_ms is None else t0 + float(max_ms) / 1000.0, idle_prices(self._ctx.config))
        steps: list[Receipt] = []
        while (self._state.pending or self._unhealed_evicted()) and budget.allows_step():
            steps.append(self._heal_step())
            budget.spend_receipt(steps[-1])
        if anticipate and not self._state.pending and not budget.timed_out():
            steps.extend(self._anticipate(budget))  # (window.anticipation; nothing unless anticipate=True)
        return Receipt.merged("heal", steps, wall_ms=(time.perf_counter() - t0) * 1000.0)

    def _unhealed_evicted(self) -> list[ChunkRef]:
        """Evicted chunks that left before their canonical was computed, which healing encodes
        (``latency-shared``; under ``latency`` their canonical waits for a recall that needs it)."""
        if self._ctx.policy.lazy_canonicals:
            return []
        return [r for r, e in self._state.evicted.items() if e.owes_encode]

    def _heal_step(self, target: ChunkRef | None = None) -> Receipt:
        """One heal transaction (see :meth:`heal`): ``target`` (a pending chunk; default: the one of
        highest :meth:`heal_priority`) and the pending chunks in front of it."""

        def body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], None]:
            ctx = self._ctx
            lazy = ctx.policy.lazy_canonicals
            slots = list(state.slots)
            index = {s.ref: i for i, s in enumerate(slots)}

            def need_of(ref: ChunkRef, i: int) -> HealNeed:
                return heal_need(i, slots[i].provisional, lazy, state.pending[ref].reconditions)

            departed = self._unhealed_evicted() if not state.pending else []
            tasks = plan_heal_step(state.refs, state.pending, self.heal_priority, need_of, departed, target)
            if not tasks:
                return {"refs": ()}, None  # healed meanwhile (e.g. by a foreground heal): nothing to do
            if tasks[0].need == "departed":  # the canonical of a chunk that left unhealed
                ref = tasks[0].key
                entry = state.evicted[ref]
                if entry.provisional is not None:
                    ingest.canonical_of(self._ctx, entry.provisional, meter)
                    source = ingest.source_of(entry.provisional)  # so a lost canonical can be rebuilt
                else:
                    source = entry.source
                    if ingest.load_canonical(ctx, entry.chunk_key, meter) is None:
                        ingest.encode_and_store(ctx, meter, **entry.source)
                state.evicted[ref] = dataclasses.replace(entry, provisional=None, unhealed=False, source=source)
                return {"refs": (ref,)}, None
            reasons = {t.key: state.pending[t.key].reason for t in tasks}
            eager = getattr(ctx.policy, "eager", ctx.policy)
            heal_policy = HealPolicy(eager, {t.key: state.pending[t.key].carried for t in tasks})
            for task in tasks:
                i = index[task.key]
                if task.need == "canonical":
                    slots[i] = self._canonicalize(slots[i], slots[:i], reasons[task.key], eager, meter)
                elif task.need == "keep":
                    del reasons[task.key]  # exact where it stands: no canonical until something needs one
                elif task.need == "reforward":  # one conditioned forward on its prefix now, after
                    # what is in front is healed and placed (the forward runs after their healed KV)
                    head = {r: reasons.pop(r) for r in task.prefix if r in reasons}
                    slots[:i], _ = reconcile(ctx, slots[:i], head, meter, policy=heal_policy)
                    slots[i] = ingest.reforward(ctx, slots[i], slots[:i], meter)
                    meter.reconditioned.add(task.key)
                    del reasons[task.key]
            state.slots, _ = reconcile(ctx, slots, reasons, meter, policy=heal_policy)
            for t in tasks:
                state.pending.pop(t.key, None)
            return {"refs": tuple(t.key for t in tasks)}, None

        return self._run("heal", body)[0]

    def _canonicalize(self, slot: Slot, prefix: Sequence[Slot], reason: str | None, eager: PatchPolicy, meter: Meter) -> Slot:
        """A provisional slot as its canonical (blind, to be re-conditioned by the eager policy).

        When the prefix is still the one its conditioned forward ran after, the patch the eager
        policy wants there is the difference between that KV and the canonical: it is formed from
        the provisional KV (an SVD, no forward) and stored, so re-conditioning finds it."""
        ctx = self._ctx
        canonical = ingest.canonical_of(self._ctx, slot.chunk, meter)
        blind = Slot(ref=slot.ref, chunk=canonical, start=slot.start, layout=ctx.layout)
        if tuple((p.ref, p.version) for p in prefix) == slot.inline_on:
            wanted = eager.decide(reason, blind, prefix, valid=False, rank=ctx.rank)
            if wanted.action == "form" and not wanted.stack:
                rk, rv = ctx.clamp_rank(wanted.rank, canonical.n_tokens)
                key = patch_store_key(ctx, blind, prefix, wanted.kind, (rk, rv))
                if (rk or rv) and not ctx.store.has(key):
                    patch = form_patch(
                        ctx.backend, canonical, antecedents=[(p.chunk, list(p.patches)) for p in prefix],
                        rank=rk, rank_v=rv, kind=wanted.kind, conditioned=(slot.chunk.keys, slot.chunk.values),
                        **dict(wanted.options),
                    )
                    failed = ctx.store.put_patch(key, patch, traffic=meter.traffic)
                    if failed:
                        meter.notes.append(failed)
                    # a stored exact patch on this prefix, as a formed one is (the placement's hint)
                    ctx.note_stored_prefix(canonical.id, tuple(p.chunk.id for p in prefix))
                    meter.patches_formed += 1  # (from the KV it holds: no forward, but a patch formed all the same)
                    meter.formed_keys.append(key)
                    meter.plan.add(Difference(canonical.id, canonical.n_tokens, antecedents=tuple(p.chunk.id for p in prefix),
                                              tier=ctx.store.tier_of(key) or "none", nbytes=patch.nbytes))
        return blind

    def start_healing(self, idle_ms: float = 20.0) -> "Healer":
        """Heal in the background while the window is idle (no foreground operation for
        ``idle_ms``): returns the running :class:`~contextdeque.window.healer.Healer` (call
        ``stop()``, or use it as a context manager). Foreground operations never wait for it
        longer than the layer in flight."""
        from .healer import Healer

        return Healer(self, idle_ms=idle_ms).start()
