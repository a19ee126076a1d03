"""Recall predictors: which evicted chunks the next steps bring back, where, and in what order,
each prediction priced so anticipation (``window.anticipation``) spends idle time where it pays.

A :class:`Prediction` is a chain of recalls (a group that left together comes back together: a
web page's screenshot and text, a video segment's frames), the probability that the agent runs
it next, its **cost** (the forming forwards' tokens, paid in idle time: each recalled chunk's
patch, its canonical where one is owed, the re-forms of the recall cascade the conditioning graph
implies) and its **benefit** (probability x the forward tokens a hit takes off the critical
path). Anticipation forms predictions in order of benefit / cost while its idle budget lasts.

A predictor is one small registered class in its own file (``core/registry`` style: set
``name``): ``recency`` (``predictor_recency.py``: the agent's hints, then the most recently
evicted) and ``session`` (``predictor_session.py``, the default: hints, recency, and statistics
learned from the window's own steps). It sees the window's finished operations
(:meth:`RecallPredictor.observe`) and the state when asked (:meth:`RecallPredictor.predict`); it
never touches the model or the store.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Collection, Iterable, Iterator, Mapping, Sequence

from ..core.errors import WindowError
from ..core.registry import Registered, Registry
from .ref import ChunkRef

if TYPE_CHECKING:  # pragma: no cover
    from .receipt import Receipt
    from .state import WindowState

RECALL_PREDICTORS: Registry["RecallPredictor"] = Registry("recall predictor")

CANDIDATES = 32
"""Evicted chunks a predictor looks at, most recently evicted first (bounds the work per idle period)."""

Recall = tuple[ChunkRef, "int | str | None"]
"""``(ref, at)``: recall ``ref`` at index ``at``, at ``"end"``, or (None) where ``recall(ref)``
puts it (the window's recall placement)."""


@dataclass(frozen=True)
class Prediction:
    """A recall chain the next steps may run (see the module doc).

    ``recalls``: ``(ref, at)`` in the order they would run; ``probability``: that the agent runs
    it next (0..1); ``cost_tokens``: tokens the forming forwards prefill when it is anticipated;
    ``saved_tokens``: forward tokens a hit takes off the critical path; ``source``: why it was
    predicted (``expected``, ``group``, ``recency``...)."""

    recalls: tuple[Recall, ...]
    probability: float
    cost_tokens: int
    saved_tokens: int
    source: str = ""

    @property
    def benefit(self) -> float:
        """Expected forward tokens saved: probability x saved tokens."""
        return self.probability * self.saved_tokens

    @property
    def ratio(self) -> float:
        """Expected benefit per idle token spent (what anticipation orders by)."""
        return self.benefit / max(1, self.cost_tokens)


class RecallPredictor(Registered):
    """Base of a recall predictor: set ``name`` and implement :meth:`predict`; learn in
    :meth:`observe` if it learns. One instance per window family (a window and its forks)."""

    registry = RECALL_PREDICTORS
    name: ClassVar[str] = ""

    def observe(self, receipt: "Receipt", state: "WindowState") -> None:
        """A window operation finished (``receipt``); ``state`` is the window after it."""

    def p_front_leaves(self) -> float:
        """Chance that the window's front chunk leaves next (a slide, or its eviction): what
        preparing the next slide (``anticipation.anticipate_slide``) is worth. 1 unless learned."""
        return 1.0

    def predict(self, state: "WindowState", expected: Mapping[ChunkRef, "int | None"]) -> list[Prediction]:
        """Predictions for ``state`` (any order: :func:`rank_predictions` orders them);
        ``expected``: what the agent said it may recall next (``window.expect``), in the order said."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def make_predictor(spec: "str | RecallPredictor") -> RecallPredictor:
    """A predictor from its registered name (or the instance itself)."""
    return RECALL_PREDICTORS.make(spec, instance_of=RecallPredictor, error=WindowError)


def rank_predictions(predictions: Iterable[Prediction]) -> list[Prediction]:
    """``predictions`` by benefit / cost, then probability (stable: equal ones keep their order);
    a chain predicted twice keeps its best-ranked copy."""
    ranked = sorted(predictions, key=lambda p: (-p.ratio, -p.probability))
    seen: set[tuple[Recall, ...]] = set()
    out = []
    for p in ranked:
        if p.recalls and p.recalls not in seen:
            seen.add(p.recalls)
            out.append(p)
    return out


class KeptCascade:
    """A conditioning graph as a window whose recalls keep their dependents as they are
    (``cascade_policy`` ``"keep"`` / ``"flag"``) shows it to predictions: no recall cascade to
    re-form, so a prediction costs and saves only the recalled chunks' own forming."""

    def __init__(self, graph: Any) -> None:
        self._graph = graph

    def preview_cascade(self, ref: ChunkRef, order: Sequence[ChunkRef]) -> tuple[ChunkRef, ...]:
        return ()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._graph, name)


def as_predicted(state: "WindowState", cascade_policy: str,
                 has_canonical: "Callable[[Any], bool] | None" = None) -> "WindowState":
    """``state`` as predictions price it under ``cascade_policy`` (``WindowConfig``): itself when
    a recall re-forms its cascade (``"reform"``), else with a :class:`KeptCascade` graph.
    ``has_canonical(entry)``: whether the canonical an evicted chunk owes is in the store already
    (an earlier preparation encoded it, where the recall then finds it): such an entry is shown
    owing nothing (an estimate that charged that encode again kept a gap's best chains from
    fitting)."""
    owed = [r for r, e in state.evicted.items() if e.owes_encode and has_canonical is not None and has_canonical(e)]
    if owed:
        state = dataclasses.replace(state, evicted={
            r: dataclasses.replace(e, unhealed=False, provisional=None) if r in owed else e for r, e in state.evicted.items()})
    if cascade_policy == "reform":
        return state
    return dataclasses.replace(state, graph=KeptCascade(state.graph))


def _chain_cascades(state: "WindowState", recalls: Sequence[Recall]) -> Iterator[tuple[Any, list[ChunkRef]]]:
    """``(evicted entry, dependents)`` per recall of ``recalls`` still evicted: the in-window
    chunks its recall cascade would re-form (the conditioning graph's dependents of it), each once
    per chain (re-formed behind the recalled chunk, it no longer depends on the later ones)."""
    redone: set[ChunkRef] = set()
    for ref, _ in recalls:
        entry = state.evicted.get(ref)
        if entry is None:
            continue
        dependents = [r for r in state.graph.preview_cascade(ref, state.refs) if r not in redone]
        redone.update(dependents)
        yield entry, dependents


def chain_tokens(state: "WindowState", recalls: Sequence[Recall]) -> tuple[int, int]:
    """``(cost_tokens, saved_tokens)`` of recalling ``recalls`` in order from ``state`` (an
    estimate, no simulation): each recalled chunk's forming forward (its tokens), the in-window
    chunks its recall cascade would re-form (a patch formed, or for latency-first content with no
    canonical the re-forward ``heal`` would run, prepared ahead, ``window.prepared``), each once
    per chain, and, in the cost only, the canonical of a chunk that left before it had one
    (encoded once anyway)."""
    cost = saved = 0
    tokens = {s.ref: s.n_tokens for s in state.slots}
    for entry, dependents in _chain_cascades(state, recalls):
        cascade = sum(tokens.get(r, 0) for r in dependents)
        saved += entry.n_tokens + cascade
        cost += entry.n_tokens + cascade + (entry.n_tokens if entry.owes_encode else 0)
    return cost, saved


def chain_work(state: "WindowState", recalls: Sequence[Recall]) -> tuple[int, list[int]]:
    """``(forwards, factorized)`` of recalling ``recalls`` in order (an estimate, as
    :func:`chain_tokens`): the forwards it runs (each recalled chunk's forming forward and its
    canonical when owed, one per dependent its recall cascade re-forms) and the tokens of each
    patch it factorizes (each recalled chunk's, and the re-forms of dependents with a canonical: a
    provisional dependent is re-forwarded, nothing factorized; consecutive ones in one forward,
    :func:`reforward_runs`). What ``WindowConfig.forward_fixed``
    / ``factorization_fixed`` / ``factorization_cost`` charge on top of the forwards' tokens."""
    order = [s.ref for s in state.slots]
    settled = {s.ref: s.n_tokens for s in state.slots if not getattr(s, "provisional", False)}
    forwards, factorized = 0, []
    for entry, dependents in _chain_cascades(state, recalls):
        redone = {r for r in dependents if r in order and r not in settled}
        forwards += 1 + int(bool(entry.owes_encode)) + sum(1 for r in dependents if r in settled) + reforward_runs(order, redone)
        factorized += [entry.n_tokens, *(settled[r] for r in dependents if r in settled)]
    return forwards, factorized


def reforward_runs(order: Sequence[ChunkRef], redone: Collection[ChunkRef]) -> int:
    """Forwards that re-forwarding the provisional chunks ``redone`` runs where they stand in
    ``order``: one per run of consecutive ones (each behind the one before it: one forward of
    their concatenation, ``ingest.reforward_run``)."""
    runs, before = 0, False
    for ref in order:
        here = ref in redone
        runs += int(here and not before)
        before = here
    return runs


def priced(state: "WindowState", recalls: Sequence[Recall], probability: float, source: str) -> Prediction:
    """A :class:`Prediction` of ``recalls`` with :func:`chain_tokens`' cost and saving."""
    cost, saved = chain_tokens(state, recalls)
    return Prediction(tuple(recalls), float(probability), cost, saved, source)


def hinted(state: "WindowState", expected: Mapping) -> list[list[Recall]]:
    """The agent's hints (``window.expect``: a ref or a group of refs -> ``at``), in the order
    given, as recall chains of their members still evicted (a group's later members follow the
    first; ``at`` as ``recall`` takes it: an index, ``"end"``, or None, where ``recall(ref)``
    without ``at`` puts it, the window's recall placement; each member so)."""
    out = []
    for group, at in expected.items():
        group = (group,) if isinstance(group, ChunkRef) else tuple(group)
        chain = [(r, at + i if isinstance(at, int) else at) for i, r in enumerate(group) if r in state.evicted]
        if chain:
            out.append(chain)
    return out


def recent_evicted(state: "WindowState") -> list[ChunkRef]:
    """The :data:`CANDIDATES` most recently evicted refs, most recent first."""
    out = []
    for ref in reversed(state.evicted):  # eviction order: the last one left most recently
        out.append(ref)
        if len(out) >= CANDIDATES:
            break
    return out
