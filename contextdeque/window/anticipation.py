"""Anticipatory healing: in idle time, form what the next likely re-reads need, so that they find
it in the store and run no forward on the critical path.

``heal()`` on a window with ``anticipate=True`` (:class:`~.config.WindowConfig`), once the queued
work is done, prepares, one transaction each (idle forwards only; the critical path is unchanged):

1. **the next slide**: the provisional slot that a slide would bring to the front gets its
   canonical now (exact at the front; latency-first content has none until a re-read needs one).
   The patch that keeps it where it stands is the SVD of its provisional KV, no second forward.
   A slide then serves the canonical at the front (0 forwards, the eager policy's fidelity).
2. **recalls**: the recall chains the window's recall predictor (``window.predictor``: what
   ``expect()`` named, recency, statistics learned from the session's own steps) ranks best by
   expected benefit per idle token, as many as the budget allows (``heal(max_tokens=...)``:
   a prediction whose estimated cost does not fit what is left is skipped; without a budget the
   best :data:`ANTICIPATED_RECALLS`). For each, the arrangement its recalls would produce, one
   after the other (the budget's slide, the eager policy's decisions for the survivors and for
   the cascade the recall implies), is simulated on a copy of the state, and the patches the
   eager policy forms there are formed and stored under their usual keys. A recall that lands in
   exactly that arrangement finds it (the patch key's antecedent signature, ``patch/keys.py``:
   the antecedents' KV states in order and the policy regime) and runs no forward; in any other
   arrangement the key differs and nothing anticipated is served. A chunk that left before its
   canonical was computed gets it (a look-back at the front needs only the canonical).
   Chunks ``expect()`` named together (a page re-read with another, a video segment's header and
   frames) are one chain, each recall on the arrangement the ones before it leave.
3. **reorders**: the orders ``expect_order()`` named, then the likeliest reorders of the current
   set, priced by probability x tokens saved per token formed (``window.anticipate_reorder``),
   simulated the same way (the eager policy's exact and orbit patches, formed and stored).

Under a token budget (``heal(max_tokens=...)``, an idle gap) a preparation too dear for the gap is
not dropped: the gap's rest is put into it and it is continued in the next gaps
(:class:`ResumableForming`, progress kept while what it attends to stands, dropped progress
counted), so a page whose forming is longer than any one gap is still prepared.

Patch keys name the antecedents' KV states (``window.kvstate``), so an anticipation is served
exactly where the KV in front of the chunk is the KV it was formed on. A pass that completes
marks the window anticipated until it changes (:attr:`WindowAnticipation.anticipation_due`); the
idle healer (``window.healer``) runs the same passes in the background.

The keys of the patches anticipation formed are remembered per window family, so receipts can say
a chunk was served ``"anticipated"`` (see ``reconcile.obtain``); a stored patch an anticipation
only found (formed earlier by an operation or a heal) keeps saying ``"recurring"`` / ``"orbit"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ..core.errors import ArgumentTypeError, WindowError
from . import ingest
from .placement import END, recall_chooser, window_index
from .plan import Forward
from .anticipate_reorder import ANTICIPATED_REORDERS, anticipate_reorder, reorder_candidates
from .healing import HealBudget, IdlePrices
from .kvstate import antecedent_states
from .policy_latency import HealPolicy
from .predictor import Prediction, RecallPredictor, as_predicted, chain_work, make_predictor, rank_predictions
from .receipt import Meter, Receipt
from .reconcile import reconcile
from .ref import ChunkRef
from .slot import Slot
from .state import WindowState

if TYPE_CHECKING:  # pragma: no cover
    from .window import ContextWindow

ANTICIPATED_RECALLS = 3
"""Recall predictions prepared per idle period when ``heal()`` has no budget (``max_tokens`` /
``max_ms``): the best ranked ones (the page that just left is the likeliest re-read)."""

MAX_PREDICTIONS = 64
"""Recall predictions looked at per idle period under a budget (the budget decides how many are formed)."""

MAX_HINTS = 16
"""Hints (:meth:`WindowAnticipation.expect`) a window keeps: the latest ones."""


def recall_candidates(win: "ContextWindow", state: WindowState) -> list[Prediction]:
    """The recalls worth preparing, best first: the window's recall predictor
    (``window.predictor``; what ``expect()`` named, recency, the session's statistics), ranked by
    expected benefit per idle token."""
    return rank_predictions(win.recall_predictor.predict(as_predicted(state, win._ctx.cascade_policy), win.expected))


def plan_recalls(predictor: RecallPredictor, state: Any, expected: dict, budgeted: bool) -> list[Prediction]:
    """The recall predictions one idle period prepares, in order: the predictor's, ranked by
    benefit per token; under a budget the best :data:`MAX_PREDICTIONS` (the budget decides how many
    are formed), without one the best :data:`ANTICIPATED_RECALLS` chains that are not the start of
    one chosen before (shorter prefixes serve a budget). ``state``: a :class:`~.state.WindowState`
    (the replay's is one of key-only slots, ``replay/anticipate.py``). The planning the window and
    the replay share."""
    ranked = rank_predictions(predictor.predict(state, expected))
    if budgeted:
        return ranked[:MAX_PREDICTIONS]
    chosen: list[Prediction] = []
    for p in ranked:
        if len(chosen) < ANTICIPATED_RECALLS and not any(c.recalls[: len(p.recalls)] == p.recalls for c in chosen):
            chosen.append(p)
    return chosen


def fulfil_hints(expected: dict, recalled: Sequence[ChunkRef]) -> dict:
    """``expected`` less the recalled refs (the hints, :meth:`WindowAnticipation.expect`): a hint
    names the *next* re-read, so once it happened it says nothing more (left in, a chunk evicted
    again later would come back to the head of the hinted chain and put every prediction built on
    the hints in a wrong arrangement). A group's later members stay hinted, following the
    recalled one (at the next index). ``expected`` itself when nothing in it was recalled."""
    done = set(recalled)
    if not done or not any(r in done for group in expected for r in group):
        return expected
    kept: dict[tuple[ChunkRef, ...], int | None] = {}
    for group, at in expected.items():
        rest = tuple(r for r in group if r not in done)
        if rest:
            first = group.index(rest[0])
            kept[rest] = at + first if isinstance(at, int) else at
    return kept


def fulfil_orders(orders: list, refs: Sequence[ChunkRef]) -> list:
    """The order hints (:meth:`WindowAnticipation.expect_order`) less the one the window now holds."""
    now = tuple(refs)
    return [o for o in orders if o != now]


def note_order(orders: list, order: tuple) -> None:
    """Record ``expect_order(order)`` in ``orders`` (the latest :data:`ANTICIPATED_REORDERS` count)."""
    if order in orders:
        orders.remove(order)
    orders.append(order)
    del orders[:-ANTICIPATED_REORDERS]


def note_hint(expected: dict, group: tuple, at: "int | str | None") -> None:
    """Record ``expect(group, at)`` in ``expected`` (the latest :data:`MAX_HINTS` hints count; a
    group named again moves to the end)."""
    expected.pop(group, None)
    expected[group] = at
    while len(expected) > MAX_HINTS:
        del expected[next(iter(expected))]


def anticipate_slide(win: "ContextWindow", state: WindowState, meter: Meter) -> ChunkRef | None:
    """Give the provisional slot a slide would bring to the front its canonical (see the module
    doc, 1.). Returns its ref, or None when there is nothing to do."""
    if len(state.slots) < 2 or not state.slots[1].provisional:
        return None
    return anticipate_canonical(win, state, state.slots[1].ref, meter)


def anticipate_canonical(win: "ContextWindow", state: WindowState, ref: ChunkRef, meter: Meter) -> ChunkRef | None:
    """Give provisional ``ref`` its canonical where it stands (a step that brings it to the front,
    a slide or a reorder, then serves the canonical there: exact, 0 forwards). The patch that keeps
    it where it stands is the SVD of its provisional KV where that KV ran behind the slots in front
    of it as they stand (no second forward; else the eager policy's ``append`` decision forms it).
    Changes ``state``. Returns ``ref``, or None when it is not a provisional slot."""
    if ref not in state.refs or not state.slots[state.index(ref)].provisional:
        return None
    ctx = win._ctx
    eager = getattr(ctx.policy, "eager", ctx.policy)
    slots = list(state.slots)
    i = state.index(ref)
    before = len(meter.formed_keys)
    slots[i] = win._canonicalize(slots[i], slots[:i], "append", eager, meter)
    state.slots, _ = reconcile(ctx, slots, {ref: "append"}, meter, policy=HealPolicy(eager))
    ctx.anticipated_keys.update(meter.formed_keys[before:])
    return ref


def anticipate_recalls(win: "ContextWindow", state: WindowState, recalls: Sequence[tuple[ChunkRef, int | None]],
                       meter: Meter, orders: Sequence[Sequence[ChunkRef]] = ()) -> bool:
    """Form and store the patches the recalls ``recalls`` (in that order) would need, each in the
    arrangement the ones before it leave (see the module doc, 2.), then those of the first of
    ``orders`` (what ``expect_order`` named) that is a reorder of the arrangement the chain
    leaves (the agent's reorder right after its recalls). ``state`` is only read (the
    simulation runs on a copy); the store gains the canonicals owed and the patches. Returns
    whether anything was formed. A recall the budget would refuse ends the chain."""
    sim = state.copy()
    formed = False
    for ref, at in recalls:
        if ref not in sim.evicted:
            break
        done = _simulate_recall(win, sim, ref, at, meter)
        if done is None:
            break
        formed |= done
    then = next((o for o in orders if set(o) == set(sim.refs) and tuple(o) != tuple(sim.refs)), None)
    if then is not None:
        formed |= anticipate_reorder(win, sim, then, meter)
    return formed


def anticipate_recall(win: "ContextWindow", state: WindowState, refs: Sequence[ChunkRef], at: int | str | None,
                      meter: Meter) -> bool:
    """:func:`anticipate_recalls` of ``refs`` in turn (``at``: the first's index, the others follow it)."""
    return anticipate_recalls(win, state, [(r, at + i if isinstance(at, int) else at) for i, r in enumerate(refs)], meter)


def _simulate_recall(win: "ContextWindow", sim: WindowState, ref: ChunkRef, at: int | None, meter: Meter) -> bool | None:
    """``recall(ref, at)`` on ``sim`` (a copy of the window's state, changed in place) with the
    eager policy's decisions, forming and storing what it needs. Returns whether anything was
    formed; None when the recall cannot be prepared (refused by the budget, no source)."""
    ctx = win._ctx
    entry = sim.evicted[ref]
    room = ctx.budget_tokens is None or sim.tokens_used + entry.n_tokens <= ctx.budget_tokens
    if not room and ctx.overflow == "error":  # that recall would be refused: nothing to prepare
        return None
    chunk = ctx.store.get_chunk(entry.chunk_key, fingerprint=ctx.fingerprint, layout=ctx.layout.signature,
                                traffic=meter.traffic)
    formed = False
    if chunk is None:
        source = entry.source if entry.source is not None else (
            ingest.source_of(entry.provisional) if entry.provisional is not None else None)
        if source is None:
            return None
        chunk = ingest.encode_and_store(ctx, meter, **source)
        formed = True
    candidates = frozenset(sim.graph.preview_cascade(ref, sim.refs))
    slots = list(sim.slots)
    reasons: dict[ChunkRef, str] = {}
    left = win._make_room(sim, slots, entry.n_tokens, reasons)
    entering = Slot(ref=ref, chunk=chunk)
    if at is None or at == END:
        pos = len(slots)
        chooser = None if at == END else recall_chooser(ctx)
        if chooser is not None:  # recall(ref) without `at`: where the window's recall placement puts it
            pos = window_index(ctx, sim.graph, slots, entering, None, entry.formed_on, policy=chooser)
    else:
        pos = max(0, min(int(at), len(slots) + len(left)) - len(left))
    del sim.evicted[ref]
    slots.insert(pos, entering)
    reasons[ref] = "recall"
    for later in slots[pos + 1:]:
        reasons[later.ref] = "inserted"
    eager = getattr(ctx.policy, "eager", ctx.policy)
    before, ops = len(meter.formed_keys), len(meter.plan.ops)
    # the eager policy's decisions on the simulated arrangement, as the recall would run them:
    # the survivors, the recalled chunk's patch, the cascade it implies (formed and stored)
    sim.slots, _ = reconcile(ctx, slots, reasons, meter, recalled=ref, cascade_candidates=candidates - set(left),
                             policy=HealPolicy(eager), prepared="run")
    # receipts say "anticipated" for what anticipation formed; a stored patch it found stays what it was
    ctx.anticipated_keys.update(meter.formed_keys[before:])
    sim.graph.sync(sim.slots, sim.evicted)
    return formed or len(meter.formed_keys) > before or any(isinstance(op, Forward) for op in meter.plan.ops[ops:])


def reorder_after(state: WindowState, recalls: Sequence[tuple[ChunkRef, int | str | None]],
                  orders: Sequence[Sequence[ChunkRef]]) -> list[ChunkRef]:
    """The chunks preparing the reorder an ``expect_order`` hint names right after ``recalls``
    re-conditions (empty: none of ``orders`` reorders the arrangement they leave): every chunk
    from the first one the reorder moves on (a patch or a provisional re-forward)."""
    after = list(state.refs)
    for ref, at in recalls:
        after.insert(min(int(at), len(after)) if isinstance(at, int) else len(after), ref)
    then = next((o for o in orders if set(o) == set(after) and list(o) != after), None)
    if then is None:
        return []
    first = next(i for i, (a, b) in enumerate(zip(after, then)) if a != b)
    return list(then[first:])


def reconditioning_cost(state: Any, refs: Sequence[ChunkRef], prices: IdlePrices) -> float:
    """What re-conditioning ``refs`` (in the window, or evicted and recalled first) is estimated to
    cost an idle budget at ``prices``: a forward each, and a factorized patch each but for a
    provisional chunk (re-forwarded, nothing factorized)."""
    tokens = {s.ref: s.n_tokens for s in state.slots} | {r: e.n_tokens for r, e in state.evicted.items()}
    provisional = {s.ref for s in state.slots if getattr(s, "provisional", False)}
    sizes = [tokens.get(r, 0) for r in refs]
    factorized = [tokens.get(r, 0) for r in refs if r not in provisional]
    return prices.charge(sum(sizes), len(sizes), sum(factorized), len(factorized))


def reorder_cost(state: Any, order: Sequence[ChunkRef], prices: IdlePrices) -> float:
    """What preparing the reorder of ``state``'s window to ``order`` is estimated to cost an idle
    budget: every chunk from the first one the reorder moves on is re-conditioned
    (:func:`reconditioning_cost`), as :func:`reorder_after` counts it, but for one it brings to
    the front (its canonical is exact there: free, or a preparation of its own when it has none)."""
    now = list(state.refs)
    first = next((i for i, (a, b) in enumerate(zip(now, order)) if a != b), len(now))
    return reconditioning_cost(state, list(order)[max(first, 1):], prices)


def recall_cost(state: Any, prediction: Prediction, reorder: Sequence[ChunkRef], prices: IdlePrices) -> float:
    """What preparing ``prediction`` (and the hinted reorder after it, ``reorder``: the chunks it
    re-conditions, :func:`reorder_after`; empty: none) is estimated to cost an idle budget at
    ``prices`` (``healing.IdlePrices``, what ``healing.idle_spent`` charges): its forwards' tokens,
    each forward's fixed part and its patches' factorizations (``predictor.chain_work``), and the
    reorder's (:func:`reconditioning_cost`). ``state``: a :class:`~.state.WindowState` (the
    replay's key-level one too)."""
    forwards, sizes = chain_work(state, prediction.recalls)
    cost = prices.charge(prediction.cost_tokens, forwards, sum(sizes), len(sizes))
    return cost + (reconditioning_cost(state, reorder, prices) if reorder else 0.0)


def slide_cost(n_tokens: int, prices: IdlePrices) -> float:
    """What preparing the next slide costs an idle budget: the canonical's forward and its patch's
    factorization (an SVD of the provisional KV)."""
    return prices.charge(n_tokens, 1, n_tokens, 1)


@dataclass
class Preparation:
    """One anticipation task :func:`plan_anticipation` hands its executor: ``kind`` ``"slide"``
    (the next slide's canonical), ``"canonical"`` (the canonical of the provisional chunk
    ``order[0]``, which a reorder to be prepared brings to the front: :func:`anticipate_canonical`),
    ``"recalls"`` (the chain ``recalls``, with the hinted reorders ``orders`` after it) or
    ``"reorder"`` (to ``order``); ``cost``: its estimated cost to an idle budget, in prefill tokens
    (None: not priced). The executor sets ``ran`` once it ran it; ``"slide"`` and ``"canonical"``
    change the window, the others only read it."""

    kind: str
    cost: float | None
    recalls: tuple = ()
    orders: Sequence = ()
    order: Sequence = ()
    ran: bool = False


def plan_anticipation(state_of: Callable[[], Any], predictor: RecallPredictor, expected: dict,
                      expected_orders: Sequence[Sequence[ChunkRef]], budgeted: bool, prices: IdlePrices,
                      slide_tokens: int | None, reorders: Callable[[], Sequence[Sequence[ChunkRef]]]) -> Iterator[Preparation]:
    """The anticipation tasks of one pass, most valuable first: the planning the window executes
    and the replay prices (``replay/anticipate.py``), over ``state_of()`` (read anew after each
    task ran: a :class:`~.state.WindowState`, the replay's of key-only slots). First the next
    slide's canonical (``slide_tokens``: the tokens of the provisional chunk at index 1, None:
    none; under a budget only when the predictor finds the front leaving at least as likely as its
    best recall: agents that keep their task in front never slide it out), then the recall
    predictions (:func:`plan_recalls`, each with the reorder the agent named right after it, then
    without it; a chain that extends one prepared in this pass costs only the rest), then the
    ``reorders()`` to prepare (priced by :func:`reorder_cost`: a gap is never charged more than
    its budget, where an unpriced reorder once ran whatever was left), each after the canonical
    of a provisional chunk it brings to the front (``"canonical"``, priced as the slide's). ``prices``: the idle
    budget's (``healing.HealBudget.prices``), what the estimates charge per forward and per
    factorized patch and token."""
    predictions = plan_recalls(predictor, state_of(), expected, budgeted)
    if slide_tokens is not None:
        top = predictions[0].probability if predictions else 0.0
        if not budgeted or predictor.p_front_leaves() >= top:
            # first: it changes the window (a canonical), which the other patches' keys name
            yield Preparation("slide", slide_cost(slide_tokens, prices))
            predictions = plan_recalls(predictor, state_of(), expected, budgeted)  # (as it now stands)
    done: dict[tuple, float] = {}  # chains prepared in this pass -> their estimated cost
    for prediction in predictions:
        then = reorder_after(state_of(), prediction.recalls, expected_orders)
        for orders in ((expected_orders, ()) if then else ((),)):
            if not orders and any(chain[: len(prediction.recalls)] == prediction.recalls for chain in done):
                continue  # the start of a chain prepared in this pass: all stored
            cost = recall_cost(state_of(), prediction, then if orders else (), prices)
            head = max((c for chain, c in done.items() if prediction.recalls[: len(chain)] == chain), default=0)
            task = Preparation("recalls", max(0, cost - head), recalls=prediction.recalls, orders=orders)
            yield task
            if task.ran:
                done[prediction.recalls] = max(cost, done.get(prediction.recalls, 0))
    named = {tuple(o) for o in expected_orders}
    for order in reorders():
        front = next((slot for slot in state_of().slots[1:] if slot.ref == order[0]), None)
        if front is not None and front.provisional and tuple(order) in named:
            # brought to the front: its canonical is what it needs there (a named order only:
            # ``anticipate_reorder.plan_reorders``)
            yield Preparation("canonical", slide_cost(front.n_tokens, prices), order=(order[0],))
        yield Preparation("reorder", reorder_cost(state_of(), order, prices), order=order)


@dataclass(frozen=True)
class FormingTask:
    """What names a preparation's forming work across idle gaps (:class:`ResumableForming`):
    ``key`` the task (its kind, recalls, hinted orders, order); ``arrangement`` the KV states of
    the window's slots in order when it came up (the window's ``kvstate.antecedent_states``, the
    replay's ``_kv_state``); ``head_len`` / ``head_cost``: the forming that depends only on the
    first ``head_len`` of them (a recall chain's own chunks: their forwards attend to what is in
    front of where they go, and their factorizations), at its estimated budget cost. The rest (the
    dependents behind, a hinted reorder) depends on the whole arrangement."""

    key: tuple
    arrangement: tuple
    head_len: int
    head_cost: float


def forming_task(task: Preparation, arrangement: Sequence[Any], state: Any, prices: IdlePrices,
                 whole: bool = False) -> FormingTask:
    """:class:`FormingTask` of ``task`` on ``arrangement`` (``state``: the window's
    :class:`~.state.WindowState`, the replay's key-level one; ``prices``: the idle budget's, as
    :func:`plan_anticipation` takes them; ``whole``:
    the head is the whole arrangement: under a token budget a recall's slide depends on every slot)."""
    arrangement = tuple(arrangement)
    n = len(arrangement)
    head_len, head_cost = n, 0.0
    if task.kind == "slide":
        head_len = min(2, n)  # its canonical and the patch that keeps it behind the front slot
    elif task.kind == "canonical" and task.order and task.order[0] in state.refs:
        head_len = min(list(state.refs).index(task.order[0]) + 1, n)  # (the same, behind the slots in front of it)
    elif task.kind == "recalls" and task.recalls:
        head_len = min(min(int(at) if isinstance(at, int) else n for _, at in task.recalls), n)
        for ref, _ in task.recalls:
            entry = state.evicted.get(ref)
            if entry is not None:  # its conditioned forward, its factorization, a canonical owed
                owed = int(bool(entry.owes_encode))
                head_cost += prices.charge(entry.n_tokens * (1 + owed), 1 + owed, entry.n_tokens, 1)
    key = (task.kind, tuple(task.recalls), tuple(tuple(o) for o in task.orders), tuple(task.order))
    return FormingTask(key, arrangement, n if whole else head_len, head_cost)


class ResumableForming:
    """Forming work carried across idle gaps: a preparation too dear for one gap is started there
    and continued in the next gaps instead of never being started (the single-gap budget wasted
    every gap shorter than a page's forming).

    The rule the window executes and the replay prices (one object per window, a fork has its
    own): at the end of a bounded pass (``HealBudget.max_tokens``), what is left of the gap is
    spent on one preparation that did not fit, the one already in progress when it is still
    planned, else the best ranked one; its progress (tokens, at the budget's price) is credited
    against its cost in the next gaps, and it runs in the gap where its cost less the credit fits
    (that gap is charged the rest only). Progress stands for the forming done in order: the
    recalled chunks' own forwards first (:attr:`FormingTask.head_cost`, valid while the slots in
    front of where they go stand), then the rest (valid while the whole arrangement stands). When
    the window moved under a task in progress, the progress beyond what still holds is dropped,
    and all of it when the task is no longer planned (the prediction changed); what is dropped is
    counted in :attr:`lost`. A gap is charged at most its budget. Only the token budget carries
    over (a wall-clock one is the machine's).

    What the window executes is a model of that split: the preparation runs as one transaction in
    the gap where it completes; a forward run by layer ranges, with the hidden state and the
    partial KV kept between gaps, gives the same KV (``model.forward.run_layers``, tested)."""

    def __init__(self) -> None:
        self.task: FormingTask | None = None  # the preparation in progress
        self.progress = 0.0  # its forming done so far, in budget tokens
        self.banked = 0.0  # every gap's rest put into a preparation in progress
        self.used = 0.0  # progress credited to preparations that then ran
        self.lost = 0.0  # progress dropped (see the class doc)
        self._missed: FormingTask | None = None
        self._seen = False

    def begin_pass(self) -> None:
        self._missed, self._seen = None, False

    def credit(self, task: FormingTask) -> float:
        """The progress ``task`` has from earlier gaps (0: none). A task in progress whose
        arrangement changed keeps only what still holds (see the class doc)."""
        mine = self.task
        if mine is None or task.key != mine.key:
            return 0.0
        if task.arrangement != mine.arrangement:
            head = task.head_len == mine.head_len and task.arrangement[:task.head_len] == mine.arrangement[:mine.head_len]
            kept = min(self.progress, mine.head_cost) if head else 0.0
            self.lost += self.progress - kept
            self.task, self.progress = (task, kept) if kept > 0 else (None, 0.0)
        return self.progress if self.task is not None else 0.0

    def cost(self, task: FormingTask, cost: float | None) -> float | None:
        """``cost`` (a preparation's estimate; None: not priced) less its credit."""
        return None if cost is None else max(0.0, cost - self.credit(task))

    def missed(self, task: FormingTask) -> None:
        """``task`` did not fit what was left of the gap."""
        if self.task is not None and task.key == self.task.key:
            self._seen = True
        elif self._missed is None:
            self._missed = task

    def ran(self, task: FormingTask, budget: HealBudget, tokens_before: float) -> None:
        """``task`` ran and ``budget`` was charged what it spent since ``tokens_before``: its
        credit comes off that charge (the gap pays the rest only)."""
        credit = self.credit(task)
        if credit:  # (progress beyond what it spent bought nothing: its estimate was above its cost)
            used = min(credit, budget.tokens - tokens_before)
            self.used += used
            self.lost += credit - used
            budget.tokens = max(tokens_before, budget.tokens - credit)
            self.task, self.progress = None, 0.0

    def end_pass(self, budget: HealBudget) -> None:
        """Spend what is left of ``budget`` (a token budget) on the preparation in progress when it
        was still planned, else on the best one that did not fit (the one in progress dropped)."""
        if budget.max_tokens is None:
            return
        rest = budget.max_tokens - budget.tokens
        target = self.task if self._seen else self._missed
        if target is None or rest <= 0:
            return
        if target is not self.task:
            self.lost += self.progress
            self.task, self.progress = target, 0.0
        self.progress += rest
        self.banked += rest
        budget.tokens = float(budget.max_tokens)


def idle_prices(config: Any) -> IdlePrices:
    """What a window's idle budget charges (``WindowConfig.factorization_cost`` /
    ``factorization_fixed`` / ``forward_fixed``)."""
    return IdlePrices(float(config.factorization_cost), float(config.factorization_fixed), float(config.forward_fixed))


class WindowAnticipation:
    """The anticipation operations of a :class:`~.window.ContextWindow` (a mixin)."""

    @property
    def expected(self) -> dict[tuple[ChunkRef, ...], int | None]:
        """What an agent said it may recall next (:meth:`expect`): groups of refs, recalled in
        order, with where the first goes (an index, ``"end"``, or None: where ``recall(ref)``
        puts it)."""
        return self.__dict__.setdefault("_expected", {})

    def expect(self, ref: "ChunkRef | Sequence[ChunkRef]", at: int | str | None = None) -> None:
        """Say that ``ref`` (an evicted chunk) may be recalled next, ``at`` as :meth:`recall`
        takes it: index ``at``, ``"end"``, or None (the default, as ``recall(ref)``): wherever the
        recall without ``at`` will put it (the window's recall placement, anywhere a stored patch
        stays valid, ``WindowConfig.recall_placement``), decided on the window as it stands when
        the preparation runs. With anticipation on, ``heal()`` prepares that recall first. A
        sequence of refs is one re-read of several chunks, recalled in that order from ``at`` on
        (a page re-read beside another, a video segment's header and frames; None: each where
        ``recall`` puts it): prepared as that sequence. A hint: nothing is formed now, and a
        recall elsewhere is served as usual.

        Raises:
            ArgumentTypeError: ``ref`` is not a ChunkRef or a sequence of them, or ``at`` is
                neither an int, ``"end"`` nor None.
            WindowError: a ref named twice, or unknown to the window."""
        self._check_open()
        if not isinstance(ref, (ChunkRef, Sequence)) or isinstance(ref, str):
            raise ArgumentTypeError(f"expect takes a ChunkRef or a sequence of them, got {type(ref).__name__}")
        if not (at is None or at == END or (isinstance(at, int) and not isinstance(at, bool))):
            raise ArgumentTypeError(f"expect: at is an index, {END!r} or None, got {at!r}")
        group = (ref,) if isinstance(ref, ChunkRef) else tuple(ref)
        if not group or len(set(group)) != len(group):
            raise WindowError("expect: name each chunk of a re-read once (at least one)")
        for r in group:
            self._state.check_known(r)
        note_hint(self.expected, group, at)

    @property
    def recall_predictor(self) -> RecallPredictor:
        """The window family's recall predictor (``WindowConfig.recall_predictor``; see
        ``window.predictor``): what anticipation prepares, and in what order."""
        ctx = self._ctx
        if ctx.predictor is None:
            ctx.predictor = make_predictor(ctx.config.recall_predictor)
        return ctx.predictor

    def _observe(self, receipt: Receipt) -> None:
        """Let the recall predictor learn from a finished operation; a recall fulfils the hints
        that named its chunk."""
        if receipt.op == "recall":
            self.__dict__["_expected"] = fulfil_hints(self.expected, receipt.refs)
        elif receipt.op == "reorder" and self.expected_orders:  # an order hint is fulfilled once the window takes it
            self.__dict__["_expected_orders"] = fulfil_orders(self.expected_orders, self._state.refs)
        self.recall_predictor.observe(receipt, self._state)

    @property
    def expected_orders(self) -> list[tuple[ChunkRef, ...]]:
        """Orders an agent said it may reorder the window to next (:meth:`expect_order`)."""
        return self.__dict__.setdefault("_expected_orders", [])

    def expect_order(self, order: Sequence[ChunkRef]) -> None:
        """Say that the window may next be reordered to ``order``: each of its refs once, and the
        evicted refs the agent said it will recall first (:meth:`expect`) where they will go.
        With anticipation on, idle time prepares that reorder first (``window.anticipate_reorder``;
        after the hinted recalls, on the arrangement they leave). A hint: nothing is formed now;
        a reorder to another order is served as usual.

        Raises:
            WindowError: ``order`` names a ref twice, leaves one of the window's refs out, or
                names one that is neither in the window nor evicted."""
        self._check_open()
        order = tuple(order)
        for ref in order:
            self._state.check_known(ref)
        extra = set(order) - set(self._state.refs)
        if len(set(order)) != len(order) or not set(self._state.refs) <= set(order) or \
                any(r not in self._state.evicted for r in extra):
            raise WindowError(f"expect_order needs each of the window's {len(self._state.refs)} refs exactly once "
                              "(and evicted refs it will recall first)")
        note_order(self.expected_orders, order)  # the latest hints count

    @property
    def anticipation_due(self) -> bool:
        """Anticipation is on and has not run to completion on the window as it stands now (its
        state, the agent's hints)."""
        return bool(self._ctx.config.anticipate) and self.__dict__.get("_anticipated_for") != self._anticipation_token()

    def _anticipation_token(self) -> tuple:
        return (id(self._state), self._state.generation, tuple(self.expected.items()), tuple(self.expected_orders))

    @property
    def forming(self) -> ResumableForming:
        """The forming work this window carries across idle gaps (:class:`ResumableForming`)."""
        return self.__dict__.setdefault("_forming", ResumableForming())

    def _anticipation_tasks(self, budgeted: bool = False) -> Iterator[tuple[Callable[[WindowState, Meter], tuple[dict[str, Any], None]], bool, float | None, tuple]]:
        """The anticipation transactions, most valuable first (:func:`plan_anticipation`):
        ``(body, mutates, cost_tokens, forming)`` for ``_run`` (cost: estimated; None: not
        priced; forming: its :func:`forming_task` on the window as it stands when it comes up)."""
        slots = self._state.slots
        ctx = self._ctx
        prices = idle_prices(ctx.config)
        tasks = plan_anticipation(lambda: as_predicted(self._state, ctx.cascade_policy), self.recall_predictor,
                                  self.expected, self.expected_orders, budgeted, prices,
                                  slots[1].n_tokens if len(slots) >= 2 and slots[1].provisional else None,
                                  lambda: reorder_candidates(self, self._state))
        for task in tasks:

            def body(state: WindowState, meter: Meter, task: Preparation = task) -> tuple[dict[str, Any], None]:
                task.ran = True
                if task.kind in ("slide", "canonical"):
                    ref = anticipate_slide(self, state, meter) if task.kind == "slide" else \
                        anticipate_canonical(self, state, task.order[0], meter)
                    return {"refs": () if ref is None else (ref,)}, None
                if task.kind == "recalls":
                    formed = anticipate_recalls(self, state, task.recalls, meter, task.orders)
                    return {"refs": tuple(r for r, _ in task.recalls) if formed else ()}, None
                formed = anticipate_reorder(self, state, list(task.order), meter)
                return {"refs": tuple(task.order) if formed else ()}, None

            yield body, task.kind in ("slide", "canonical"), task.cost, forming_task(
                task, antecedent_states(self._state.slots), self._state, prices, whole=ctx.budget_tokens is not None)

    def _anticipate(self, budget: "HealBudget | None" = None) -> list[Receipt]:
        """The anticipation steps ``heal()`` (or the idle healer) runs once nothing is queued (see
        the module doc), on what is left of ``budget`` (``healing.HealBudget``, checked between
        steps: its ``max_steps`` count the steps that formed something; a recall prediction whose
        estimated cost does not fit its ``max_tokens`` is skipped, a cheaper one further down may
        fit). A run that completes marks the window as anticipated (:attr:`anticipation_due` turns
        False until it changes); an interruption leaves the steps done so far (each a whole
        transaction)."""
        budget = budget if budget is not None else HealBudget()
        steps: list[Receipt] = []
        if not self.anticipation_due or (budget.max_steps is not None and budget.steps >= budget.max_steps):
            return steps
        self._ctx.prepared.new_pass()  # (what earlier passes prepared goes first when the bound is reached)
        forming = self.forming
        forming.begin_pass()
        complete = True
        for body, mutates, cost, work in self._anticipation_tasks(budget.bounded):
            if (budget.max_steps is not None and budget.steps >= budget.max_steps) or budget.timed_out():
                return steps
            if not budget.fits(forming.cost(work, cost)):
                complete = False
                forming.missed(work)
                continue  # too dear for what is left (started with the gap's rest: ResumableForming)
            spent = budget.tokens
            receipt = self._run("anticipate", body, mutates=mutates)[0]
            if receipt.refs or receipt.forwards:  # (prepared re-forwards form no patch but ran forwards)
                steps.append(receipt)
                budget.spend_receipt(receipt)
            forming.ran(work, budget, spent)
        forming.end_pass(budget)
        if complete:
            self.__dict__["_anticipated_for"] = self._anticipation_token()
        return steps


simulate_recall = _simulate_recall  # (the name other modules use)
