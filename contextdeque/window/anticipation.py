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
   the antecedent chunk ids in order and the policy regime) and runs no forward; in any other
   arrangement the key differs and nothing anticipated is served. A chunk that left before its
   canonical was computed gets it (a look-back at the front needs only the canonical).

The keys of anticipated patches are remembered per window family, so receipts can say a chunk
was served ``"anticipated"`` (see ``reconcile.obtain``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

from . import ingest
from .placement import END, recall_chooser, window_index
from .policy_latency import HealPolicy
from .predictor import Prediction, RecallPredictor, make_predictor, rank_predictions
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
    return rank_predictions(win.recall_predictor.predict(state, win.expected))


def anticipate_slide(win: "ContextWindow", state: WindowState, meter: Meter) -> ChunkRef | None:
    """Give the provisional slot a slide would bring to the front its canonical (see the module
    doc, 1.). Returns its ref, or None when there is nothing to do."""
    if len(state.slots) < 2 or not state.slots[1].provisional:
        return None
    ctx = win._ctx
    eager = getattr(ctx.policy, "eager", ctx.policy)
    slots = list(state.slots)
    slot = slots[1]
    slots[1] = win._canonicalize(slot, slots[:1], "append", eager, meter)
    state.slots, _ = reconcile(ctx, slots, {slot.ref: "append"}, meter, policy=HealPolicy(eager))
    return slot.ref


def anticipate_recalls(win: "ContextWindow", state: WindowState, recalls: Sequence[tuple[ChunkRef, int | None]],
                       meter: Meter) -> bool:
    """Form and store the patches the recalls ``recalls`` (in that order) would need, each in the
    arrangement the ones before it leave (see the module doc, 2.). ``state`` is only read (the
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
    return formed


def anticipate_recall(win: "ContextWindow", state: WindowState, ref: ChunkRef, at: int | None, meter: Meter) -> bool:
    """:func:`anticipate_recalls` of one recall."""
    return anticipate_recalls(win, state, [(ref, at)], meter)


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
        chooser = None if at == END else recall_chooser(ctx)[0]
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
    before = meter.patches_formed
    # the eager policy's decisions on the simulated arrangement, as the recall would run them:
    # the survivors, the recalled chunk's patch, the cascade it implies (formed and stored)
    placed, _ = reconcile(ctx, slots, reasons, meter, recalled=ref, cascade_candidates=candidates - set(left),
                          policy=HealPolicy(eager))
    for new, old in zip(placed, slots):
        if new.stack is not old.stack:
            ctx.anticipated_keys.update(cond.key for cond in new.stack if cond.key)
    sim.slots = placed
    sim.graph.sync(sim.slots, sim.evicted)
    return formed or meter.patches_formed > before


class WindowAnticipation:
    """The anticipation operations of a :class:`~.window.ContextWindow` (a mixin)."""

    @property
    def expected(self) -> dict[ChunkRef, int | None]:
        """Refs an agent said it may look at next (:meth:`expect`), with where (None: the end)."""
        return self.__dict__.setdefault("_expected", {})

    def expect(self, ref: ChunkRef, at: int | None = None) -> None:
        """Say that ``ref`` (an evicted chunk) may be recalled next, at index ``at`` (None: the
        end): with anticipation on, ``heal()`` prepares that recall first. A hint: nothing is
        formed now, and a recall elsewhere is served as usual."""
        self._check_open()
        self._state.check_known(ref)
        self.expected.pop(ref, None)
        self.expected[ref] = at
        while len(self.expected) > MAX_HINTS:  # the latest hints count
            del self.expected[next(iter(self.expected))]

    @property
    def recall_predictor(self) -> RecallPredictor:
        """The window family's recall predictor (``WindowConfig.recall_predictor``; see
        ``window.predictor``): what anticipation prepares, and in what order."""
        ctx = self._ctx
        if ctx.predictor is None:
            ctx.predictor = make_predictor(ctx.config.recall_predictor)
        return ctx.predictor

    def _observe(self, receipt: Receipt) -> None:
        """Let the recall predictor learn from a finished operation; a recall uses up its hint."""
        if receipt.op == "recall" and "_expected" in self.__dict__:
            for ref in receipt.refs:
                self.expected.pop(ref, None)
        self.recall_predictor.observe(receipt, self._state)

    def _anticipate(self, max_steps: int | None, max_tokens: int | None = None,
                    deadline: float | None = None) -> list[Receipt]:
        """The anticipation steps ``heal()`` runs once nothing is queued (see the module doc):
        recall predictions in ranked order, each formed only if its estimated cost fits what is
        left of ``max_tokens`` (a dearer one is skipped for a cheaper one further down); stops
        after ``max_steps`` steps or at ``deadline`` (``time.perf_counter()``)."""
        steps: list[Receipt] = []
        if not self._ctx.config.anticipate or (max_steps is not None and max_steps <= 0):
            return steps

        def spent() -> int:
            return sum(r.tokens_prefilled for r in steps)

        def slide_body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], None]:
            ref = anticipate_slide(self, state, meter)
            return {"refs": () if ref is None else (ref,)}, None

        budgeted = max_tokens is not None or deadline is not None
        predictions: list[Prediction | None] = list(
            recall_candidates(self, self._state)[: MAX_PREDICTIONS if budgeted else ANTICIPATED_RECALLS])
        # what the agent said comes first, then the next slide's canonical, then the other predictions
        hinted = sum(1 for p in predictions if p is not None and p.source == "expected")
        predictions.insert(hinted, None)
        for prediction in predictions:
            if prediction is None:
                if max_tokens is None or spent() < max_tokens:
                    receipt = self._run("anticipate", slide_body)[0]
                    if receipt.refs:
                        steps.append(receipt)
                continue
            if max_steps is not None and len(steps) >= max_steps:
                break
            if deadline is not None and time.perf_counter() >= deadline:
                break
            if max_tokens is not None and spent() + prediction.cost_tokens > max_tokens:
                continue  # too dear for what is left: a cheaper one further down may fit

            def recall_body(state: WindowState, meter: Meter, recalls=prediction.recalls) -> tuple[dict[str, Any], None]:
                formed = anticipate_recalls(self, state, recalls, meter)
                return {"refs": tuple(r for r, _ in recalls) if formed else ()}, None

            receipt = self._run("anticipate", recall_body, mutates=False)[0]
            if receipt.refs:
                steps.append(receipt)
        return steps
