"""Anticipatory healing: in idle time, form what the next likely re-reads need, so that they find
it in the store and run no forward on the critical path.

``heal()`` on a window with ``anticipate=True`` (:class:`~.config.WindowConfig`), once the queued
work is done, prepares, one transaction each (idle forwards only; the critical path is unchanged):

1. **the next slide**: the provisional slot that a slide would bring to the front gets its
   canonical now (exact at the front; latency-first content has none until a re-read needs one).
   The patch that keeps it where it stands is the SVD of its provisional KV, no second forward.
   A slide then serves the canonical at the front (0 forwards, the eager policy's fidelity).
2. **recalls**: the chunks ``expect()`` named, then the evicted chunks, most recently evicted
   first, at the end and in front (:data:`ANTICIPATED_RECALLS` arrangements in all): the
   arrangement the recall would produce (the budget's slide, the eager policy's decisions for the
   survivors and for the cascade the recall implies) is simulated on a copy of the state, and the
   patches the eager policy forms there are formed and stored under their usual keys. Chunks
   ``expect()`` named together (a page re-read with another, a video segment's header and
   frames) are simulated as one sequence, each recall on the arrangement the ones before it
   leave, as the agent will run them. A
   recall that lands in exactly that arrangement finds it (the patch key's antecedent signature,
   ``patch/keys.py``: the antecedents' KV states in order and the policy regime) and runs no
   forward; in any other arrangement the key differs and nothing anticipated is served.
   A chunk that left before its canonical was computed gets it (a look-back at the front needs
   only the canonical).
3. **reorders**: the orders ``expect_order()`` named, then the likeliest reorders of the current
   set, priced by probability x tokens saved per token formed (``window.anticipate_reorder``),
   simulated the same way (the eager policy's exact and orbit patches, formed and stored).

Patch keys name the antecedents' KV states (``window.kvstate``), so an anticipation is served
exactly where the KV in front of the chunk is the KV it was formed on. A pass that completes
marks the window anticipated until it changes (:attr:`WindowAnticipation.anticipation_due`); the
idle healer (``window.healer``) runs the same passes in the background.

The keys of anticipated patches are remembered per window family, so receipts can say a chunk
was served ``"anticipated"`` (see ``reconcile.obtain``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ..core.errors import ArgumentTypeError, WindowError
from . import ingest
from .anticipate_reorder import ANTICIPATED_REORDERS, anticipate_reorder, reorder_candidates
from .policy_latency import HealPolicy
from .receipt import Meter, Receipt
from .reconcile import reconcile
from .ref import ChunkRef
from .slot import Slot
from .state import WindowState

if TYPE_CHECKING:  # pragma: no cover
    from .window import ContextWindow

ANTICIPATED_RECALLS = 3
"""Recall arrangements prepared per idle period: what ``expect()`` named (latest first), then the
most recently evicted chunks, each back at the end and as a look-back in front (the page that
just left is the likeliest re-read)."""


def recall_candidates(win: "ContextWindow", state: WindowState) -> list[tuple[tuple[ChunkRef, ...], int | None]]:
    """``(refs, at)`` for the recalls worth preparing, most likely first: the expected groups
    (latest first; their members still evicted, in order: a group partly recalled continues
    where it stands), then evicted refs by recency (``at=None``: the window's end)."""
    out: list[tuple[tuple[ChunkRef, ...], int | None]] = []
    for group, at in reversed(win.expected.items()):
        left = tuple(r for r in group if r in state.evicted)
        if left:
            done = group.index(left[0])  # members already back: the rest continue behind them
            out.append((left, None if at is None else at + done))
    for ref in reversed(list(state.evicted)):  # eviction order: the last one left most recently
        for at in (None, 0):  # back at the end, or a look-back in front
            if ((ref,), at) not in out:
                out.append(((ref,), at))
    return out[:ANTICIPATED_RECALLS]


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


def anticipate_recall(win: "ContextWindow", state: WindowState, refs: Sequence[ChunkRef], at: int | None,
                      meter: Meter) -> bool:
    """Form and store the patches ``recall(ref, at)`` of each of ``refs`` in turn would need now
    (see the module doc, 2.; ``at`` is the first's index, the others follow it). The state is only
    read (the simulation runs on a copy); the store gains the canonicals (if owed) and the
    patches. Returns whether anything was formed."""
    sim = state.copy()
    formed = False
    for i, ref in enumerate(refs):
        done = simulate_recall(win, sim, ref, None if at is None else at + i, meter)
        if done is None:  # that recall would be refused: the rest of the sequence never happens
            break
        formed = done or formed
    return formed


def simulate_recall(win: "ContextWindow", sim: WindowState, ref: ChunkRef, at: int | None, meter: Meter) -> bool | None:
    """Run ``recall(ref, at)`` on ``sim`` (a copy of the state, left as the recall leaves it) with
    the eager policy's decisions, forming and storing what they need. Returns whether anything was
    formed; None when the recall would be refused (nothing done)."""
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
    pos = len(slots) if at is None else max(0, min(int(at), len(slots) + len(left)) - len(left))
    del sim.evicted[ref]
    slots.insert(pos, Slot(ref=ref, chunk=chunk))
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
    def expected(self) -> dict[tuple[ChunkRef, ...], int | None]:
        """What an agent said it may recall next (:meth:`expect`): groups of refs, recalled in
        order, with where the first goes (None: the end)."""
        return self.__dict__.setdefault("_expected", {})

    def expect(self, ref: "ChunkRef | Sequence[ChunkRef]", at: int | None = None) -> None:
        """Say that ``ref`` (an evicted chunk) may be recalled next, at index ``at`` (None: the
        end): with anticipation on, ``heal()`` prepares that recall first. A sequence of refs is
        one re-read of several chunks, recalled in that order from ``at`` on (a page re-read
        beside another, a video segment's header and frames): prepared as that sequence. A hint:
        nothing is formed now, and a recall elsewhere is served as usual."""
        self._check_open()
        if not isinstance(ref, (ChunkRef, Sequence)) or isinstance(ref, str):
            raise ArgumentTypeError(f"expect takes a ChunkRef or a sequence of them, got {type(ref).__name__}")
        group = (ref,) if isinstance(ref, ChunkRef) else tuple(ref)
        if not group or len(set(group)) != len(group):
            raise WindowError("expect: name each chunk of a re-read once (at least one)")
        for r in group:
            self._state.check_known(r)
        self.expected.pop(group, None)
        self.expected[group] = at
        while len(self.expected) > ANTICIPATED_RECALLS:  # the latest hints count
            del self.expected[next(iter(self.expected))]

    @property
    def expected_orders(self) -> list[tuple[ChunkRef, ...]]:
        """Orders an agent said it may reorder the window to next (:meth:`expect_order`)."""
        return self.__dict__.setdefault("_expected_orders", [])

    def expect_order(self, order: Sequence[ChunkRef]) -> None:
        """Say that the window may next be reordered to ``order`` (a permutation of its refs):
        with anticipation on, idle time prepares that reorder first (``window.anticipate_reorder``).
        A hint: nothing is formed now; a reorder to another order is served as usual.

        Raises:
            WindowError: ``order`` is not a permutation of the window's refs."""
        self._check_open()
        order = tuple(order)
        for ref in order:
            self._state.check_known(ref)
        if sorted(order, key=lambda r: r.key) != sorted(self._state.refs, key=lambda r: r.key):
            raise WindowError(f"expect_order needs each of the window's {len(self._state.refs)} refs exactly once")
        hints = self.expected_orders
        if order in hints:
            hints.remove(order)
        hints.append(order)
        del hints[:-ANTICIPATED_REORDERS]  # the latest hints count

    @property
    def anticipation_due(self) -> bool:
        """Anticipation is on and has not run to completion on the window as it stands now (its
        state, the agent's hints)."""
        return bool(self._ctx.config.anticipate) and self.__dict__.get("_anticipated_for") != self._anticipation_token()

    def _anticipation_token(self) -> tuple:
        return (id(self._state), self._state.generation, tuple(self.expected.items()), tuple(self.expected_orders))

    def _anticipation_tasks(self) -> Iterator[tuple[Callable[[WindowState, Meter], tuple[dict[str, Any], None]], bool]]:
        """The anticipation transactions, most valuable first, each planned on the window as it
        stands when its turn comes: ``(body, mutates)`` for ``_run``."""

        def slide_body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], None]:
            ref = anticipate_slide(self, state, meter)
            return {"refs": () if ref is None else (ref,)}, None

        yield slide_body, True
        for refs, at in recall_candidates(self, self._state):

            def recall_body(state: WindowState, meter: Meter, refs: tuple[ChunkRef, ...] = refs,
                            at: int | None = at) -> tuple[dict[str, Any], None]:
                formed = anticipate_recall(self, state, refs, at, meter)
                return {"refs": refs if formed else ()}, None

            yield recall_body, False
        for order in reorder_candidates(self, self._state):

            def reorder_body(state: WindowState, meter: Meter, order: list[ChunkRef] = order) -> tuple[dict[str, Any], None]:
                formed = anticipate_reorder(self, state, order, meter)
                return {"refs": tuple(order) if formed else ()}, None

            yield reorder_body, False

    def _anticipate(self, max_steps: int | None, deadline: float | None = None) -> list[Receipt]:
        """The anticipation steps ``heal()`` (or the idle healer) runs once nothing is queued (see
        the module doc), until ``max_steps`` formed something or ``deadline`` (``time.perf_counter``)
        passed, checked between steps. A run that completes marks the window as anticipated
        (:attr:`anticipation_due` turns False until it changes); an interruption leaves the steps
        done so far (each a whole transaction: their patches are stored whole, under exact keys)."""
        steps: list[Receipt] = []
        if not self.anticipation_due or (max_steps is not None and max_steps <= 0):
            return steps
        for body, mutates in self._anticipation_tasks():
            if (max_steps is not None and len(steps) >= max_steps) or (deadline is not None and time.perf_counter() >= deadline):
                return steps
            receipt = self._run("anticipate", body, mutates=mutates)[0]
            if receipt.refs:
                steps.append(receipt)
        self.__dict__["_anticipated_for"] = self._anticipation_token()
        return steps
