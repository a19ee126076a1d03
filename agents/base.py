"""What every agent shares: its configuration, a recorded run over one ``ContextWindow`` (every
window operation goes into the current step's receipts and into a replay trace), the per-step
report, and the query measurement (answer, next-token KL and time to first token against a full
re-prefill of the same window, tokens a prefix cache would prefill).

Accounting, the same for every agent:

- contextdeque's tokens and forwards for a step are what the window's receipts say (encodes,
  patch forms), plus the query's own prefill at a query step; the run totals add the healing
  done in the idle time between steps (``AgentConfig.heal_between_steps``; ``idle_heal``);
- a re-prefill prefills, at every query, the root, every chunk in the window and the query;
- a prefix cache prefills, at every query, what follows the longest token prefix this request
  shares with the previous query's;
- both only pay at queries (reading a page costs them nothing until the model is asked), so run
  totals compare everything contextdeque spent, reading included, with what they spend at queries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, Sequence

from contextdeque.core.counters import OMIT, Counters, shown
from contextdeque.core.errors import WindowError
from contextdeque.core.metrics import kl_divergence
from contextdeque.traces import TraceBuilder, TraceHeader, content_hash, write_trace
from contextdeque.window import DEFAULT_RANK, ChunkRef, ContextWindow, Receipt, WindowConfig
from contextdeque.window.policy import PATCH_POLICIES
from contextdeque.window.policy_default import SURVIVOR_STALENESS, DefaultPolicy
from contextdeque.window.policy_latency import LatencyPolicy

from .measure import common_prefix, reprefill_first_token, window_first_token, window_stream

_PHASE_LISTENER: ContextVar[Callable[[str], None] | None] = ContextVar("agent_phase_listener", default=None)


@contextlib.contextmanager
def phase_listener(listener: Callable[[str], None]) -> Iterator[None]:
    """While the block runs, every agent's query calls ``listener`` with its phase as it enters
    it: ``"window"`` (the window's own first token), ``"re-prefill"`` (the side-by-side
    measurement), ``"answer"`` (decoding), ``"done"``. A progress display hangs on it; the agents
    need no argument for it."""
    token = _PHASE_LISTENER.set(listener)
    try:
        yield
    finally:
        _PHASE_LISTENER.reset(token)


def _phase(name: str) -> None:
    listener = _PHASE_LISTENER.get()
    if listener is not None:
        listener(name)


@dataclass
class AgentConfig:
    """How an agent drives its window.

    ``budget_tokens``: the window's token budget (smaller than the document / site / video).
    ``rank``: patch rank m (None: the agent's own ``default_rank``, :meth:`with_default_rank`; the
    DocAgent's is measured for its pages, the others' is ``DEFAULT_RANK``). ``fidelity_target``:
    adaptive rank target where the window supports it (``ContextWindow(fidelity_target=)``), else refused. ``patch_policy``: ``default``,
    ``exact``, ``none`` or another registered name. ``cascade_policy``: see ``ContextWindow``.
    ``placement``: where the window puts appended and recalled chunks (``"arrival"``,
    ``"scheduler"``; see ``ContextWindow``). ``max_new_tokens``: answer length. ``measure``: at
    every query, also measure next-token KL and time to first token against a full re-prefill.
    ``seed``: seeds the scripted navigation. ``store``: a shared store (default: in memory).
    ``heal_between_steps``: before each step, ``window.heal()`` what a latency-first window (the
    default policy) deferred: the agent's idle time (waiting on pages, tools, users), timed in
    no step, its work counted in the run totals; each step then starts from the window the eager
    policy builds, whatever the timing. ``anticipate``: that idle time also prepares what the
    agent says it will re-read next (``window.expect``) and the window's likeliest re-reads
    (``ContextWindow(anticipate=True)``), so those re-reads run no forward on the critical path.
    ``survivor_staleness``: a chunk that stays in the window while much of what it was
    conditioned on leaves (staleness above this) is re-conditioned on what now precedes it — in
    idle time under the latency-first default, in the step under ``eager`` (the eager policy's
    ``survivor_staleness``; None: survivors are kept as they are).
    """

    budget_tokens: int = 640
    rank: int | None = None
    fidelity_target: float | None = None
    patch_policy: Any = "default"
    cascade_policy: str = "reform"
    placement: str = "arrival"
    max_new_tokens: int = 24
    measure: bool = True
    seed: int = 0
    store: Any = None
    heal_between_steps: bool = True
    anticipate: bool = True
    survivor_staleness: float | None = SURVIVOR_STALENESS

    def policy(self) -> Any:
        """The window's patch policy: ``patch_policy``, with ``survivor_staleness`` given to the
        eager policy it is or wraps (a name without an argument; an instance is used as is)."""
        spec = "latency" if self.patch_policy == "default" else self.patch_policy
        if self.survivor_staleness is None or not isinstance(spec, str) or spec not in PATCH_POLICIES:
            return self.patch_policy
        cls = PATCH_POLICIES[spec]
        if issubclass(cls, DefaultPolicy):
            return cls(survivor_staleness=self.survivor_staleness)
        if issubclass(cls, LatencyPolicy):
            return cls("eager", survivor_staleness=self.survivor_staleness)
        return self.patch_policy

    def with_default_rank(self, rank: int) -> "AgentConfig":
        """This config, with ``rank`` where it names none (an agent's own default rank)."""
        return self if self.rank is not None else dataclasses.replace(self, rank=int(rank))

    def window_config(self) -> WindowConfig:
        """The agent window's settings, validated once (the store is handed to the window beside them)."""
        return WindowConfig(
            budget_tokens=self.budget_tokens, rank=DEFAULT_RANK if self.rank is None else self.rank,
            patch_policy=self.policy(),
            cascade_policy=self.cascade_policy, placement=self.placement, fidelity_target=self.fidelity_target,
            anticipate=self.anticipate,
        )


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


@dataclass
class Step(Counters):
    """One row of an agent's report.

    ``op``: what the agent did (``read``, ``visit``, ``watch``, ``query``...); ``detail``: on what,
    and what the window did (recalls, drops, reorders, slides). ``forwards`` / ``tokens``:
    contextdeque's model forwards and tokens prefilled for the step (window operations, plus the
    query's prefill at a query step; the step's :class:`Counters`, its receipts added, with
    ``tokens`` = ``tokens_prefilled``); ``encodes``: chunks encoded. At a query step also
    ``reprefill_tokens`` / ``prefix_cache_tokens`` (what those would prefill for this request),
    ``ms`` (the step's window operations + time to the first answer token) against
    ``reprefill_ms`` (a full re-prefill of the same window + the query, measured right after),
    the ``answer``, ``kl`` (next-token KL(re-prefill ‖ window), nats) and ``same_next_token``
    (the window's most likely next token is the re-prefill's); ``choice``: the model
    picked among fixed choices (a yes/no judgement) rather than answering in free text. ``window``: the labels
    in the window after the step. ``idle_forwards`` / ``idle_tokens``: the healing done in the idle
    time just before the step (``AgentConfig.heal_between_steps``): off the step's clock, but
    contextdeque's work all the same, so a run's token total is ``tokens`` + ``idle_tokens`` summed.
    """

    json_omit = frozenset({"patches_formed", "patches_reused"})  # (the receipts hold them)
    json_names = {"tokens_prefilled": "tokens"}

    index: int
    op: str
    detail: str = ""
    ms: float = shown(_ms, default=0.0)
    reprefill_tokens: int | None = None
    prefix_cache_tokens: int | None = None
    reprefill_ms: float | None = shown(_ms)
    question: str | None = None
    answer: str | None = None
    kl: float | None = None
    same_next_token: bool | None = None
    choice: bool = False
    window: tuple[str, ...] = ()
    receipts: list[Receipt] = shown(OMIT, factory=list, repr=False)
    notes: list[str] = field(default_factory=list)
    idle_forwards: int = 0
    idle_tokens: int = 0

    @property
    def tokens(self) -> int:
        """Tokens prefilled for the step (``tokens_prefilled``)."""
        return self.tokens_prefilled


def query_ids(backend: Any, question: str) -> list[int]:
    """The question's token ids, closing the user turn the window root opened (chat template)."""
    from contextdeque.model.text import query_suffix, tokenize

    return tokenize(backend, "\n\n" + question + query_suffix(backend))


class AgentRun:
    """One agent's recorded run over its own ``ContextWindow``.

    Every window operation goes through this object: it lands in the open step's receipts and in
    the replay trace (``contextdeque.traces`` format, ``generator`` = the agent kind). Chunks are
    named by labels the agent chooses (``p3``, ``page:/topics.html``, ``seg2/f1``...).

    ``on_step``: called with each finished :class:`Step` (the demo's live table).
    """

    def __init__(self, backend: Any, config: AgentConfig, *, generator: str, agent: str,
                 on_step: Callable[[Step], None] | None = None) -> None:
        self.backend = backend
        self.config = config = config.with_default_rank(DEFAULT_RANK)  # (the agents resolve theirs first)
        self.window = ContextWindow.from_config(backend, config.window_config(), store=config.store)
        self.trace = TraceBuilder(TraceHeader(generator=generator, agent=agent, seed=config.seed,
                                              meta={"model": str(getattr(backend, "name", "")),
                                                    "budget_tokens": config.budget_tokens}))
        self.steps: list[Step] = []
        self.on_step = on_step
        self.label_of: dict[ChunkRef, str] = {}
        self.ref_of: dict[str, ChunkRef] = {}
        self._step: Step | None = None
        self._t0 = 0.0
        self._last_query_stream: list[Hashable] = []
        self._run_t0 = time.perf_counter()
        self.idle_heals: list[Receipt] = []  # heal() receipts of the idle time between steps

    # ------------------------------------------------------------------ steps
    def begin(self, op: str, detail: str = "", *, ahead: Sequence[dict[str, Any]] = (),
              leaving: Sequence[str] = ()) -> Step:
        """Open a step. Before it, in the idle time between steps, the window heals
        (``heal_between_steps``) and, for ``ahead`` (``append`` arguments of new content the step
        will append after evicting ``leaving``: a document's next page, a video's next segment),
        reads it ahead (:meth:`read_ahead`)."""
        if self._step is not None:
            raise WindowError("a step is already open")
        healed = self._heal()
        if ahead and self.config.anticipate:
            ready = self.read_ahead(ahead, leaving)
            healed = ready if healed is None else Receipt.merged("heal", [healed, ready])
        self._step = Step(index=len(self.steps) + 1, op=op, detail=detail)
        if healed is not None:
            self._step.idle_forwards, self._step.idle_tokens = healed.forwards, healed.tokens_prefilled
        self.trace.step(t=round((time.perf_counter() - self._run_t0) * 1000.0, 3), label=f"{op} {detail}".strip())
        self._t0 = time.perf_counter()
        return self._step

    def _heal(self) -> Receipt | None:
        """Heal (and, with ``anticipate``, prepare what comes next) in idle time: recorded in
        ``idle_heals`` when it did anything."""
        healed = self.window.heal() if self.config.heal_between_steps else None
        if healed is None or not healed.refs:
            return None
        self.idle_heals.append(healed)
        return healed

    def read_ahead(self, contents: Sequence[dict[str, Any]], leaving: Sequence[str] = ()) -> Receipt:
        """New content the next step appends, known before it (a document's next page, a video's
        next segment): in idle time, encode its canonicals and rehearse the step on a fork of the
        window (evict ``leaving``, append ``contents``: ``append`` arguments with ``token_ids`` or
        ``embeds``), healed there, so the patches the eager policy gives the content where it
        will land (and to the chunks left behind by the evictions and the budget's slide) are in
        the shared store; the fork is discarded. The step's same operations on the same window
        then find the canonicals and those patches and run no forward (each key names the exact
        KV states in front of it: a different arrangement misses and runs as usual). Recorded in
        ``idle_heals``; returns the work as one receipt (``op="read-ahead"``)."""
        t0 = time.perf_counter()
        work: list[Receipt] = []
        fork = self.window.fork()
        try:
            for label in leaving:
                work.append(fork.evict(self.ref_of[label]))
            for content in contents:
                chunk = self.backend.encode(**content)
                work.append(Receipt("encode", forwards=1, tokens_prefilled=chunk.n_tokens, encodes=1))
                work.append(fork.append(chunk=chunk).receipt)  # type: ignore[arg-type]
            while fork.pending_refs:  # the eager policy's patches, one heal step at a time (no anticipation)
                healed = fork.heal(max_steps=1)
                work.append(healed)
                if not healed.refs:
                    break
        finally:
            fork.discard()
        ready = Receipt.merged("read-ahead", work, wall_ms=(time.perf_counter() - t0) * 1000.0)
        self.idle_heals.append(ready)
        return ready

    def idle(self, why: str) -> Receipt | None:
        """An idle moment inside the open step (``why``: what the agent waits on, e.g. a page
        load): the window heals as between steps, off the step's clock (its time is not the
        step's; its work is the step's ``idle_forwards`` / ``idle_tokens`` and in the totals)."""
        st = self._need_step()
        t0 = time.perf_counter()
        healed = self._heal()
        self._t0 += time.perf_counter() - t0  # the wait is not the step's time
        if healed is not None:
            st.idle_forwards += healed.forwards
            st.idle_tokens += healed.tokens_prefilled
            st.notes.append(f"{why}: healed {healed.forwards} forwards in the wait")
        return healed

    def expect(self, labels: Sequence[str], at: int | None = None) -> None:
        """Say what the agent will re-read next: the chunks ``labels`` that left the window, in
        the order it will recall them from index ``at`` (None: the end, where :meth:`recall` puts
        them). The window prepares that sequence in the next idle time (``window.expect``); nothing
        is formed now."""
        refs = [self.ref_of[lab] for lab in labels if lab in self.ref_of and not self.in_window(lab)]
        if refs and self.config.anticipate:
            self.window.expect(refs, at="end" if at is None else at)  # (as recall asks the window)

    def expect_order(self, labels: Sequence[str]) -> None:
        """Say that the next step reorders the window to ``labels`` (all of its chunks): the
        window prepares that reorder in the next idle time (``window.expect_order``)."""
        if self.config.anticipate:
            self.window.expect_order([self.ref_of[lab] for lab in labels])

    def end(self) -> Step:
        st = self._need_step()
        if st.question is None:
            st.ms = (time.perf_counter() - self._t0) * 1000.0
        st.window = tuple(self.label_of[r] for r in self.window.refs)
        self.steps.append(st)
        self._step = None
        if self.on_step is not None:
            self.on_step(st)
        return st

    def _need_step(self) -> Step:
        if self._step is None:
            raise WindowError("no step is open: call begin() first")
        return self._step

    def _account(self, receipt: Receipt) -> Receipt:
        st = self._need_step()
        st.receipts.append(receipt)
        st += receipt  # (its Counters)
        return receipt

    def _left(self, receipt: Receipt) -> None:
        """Chunks the budget pushed out: the trace says the window slid."""
        if receipt.left:
            self.trace.slide(len(receipt.left))
            self._need_step().notes.append("slid out " + ", ".join(self.label_of[r] for r in receipt.left))

    # ------------------------------------------------------------------ window operations
    def append(self, label: str, *, trace_modality: str = "text", content_key: str | None = None, **kwargs: Any) -> ChunkRef:
        """``window.append(**kwargs)`` as chunk ``label`` (a label seen before that left the window
        should be recalled instead); the trace records it as ``trace_modality`` (``text``,
        ``image`` or ``frame``)."""
        if label in self.ref_of:
            raise WindowError(f"chunk {label!r} was appended before: recall it")
        ref = self.window.append(**kwargs)
        rc = self._account(ref.receipt)  # type: ignore[arg-type]
        self._left(rc)
        self.label_of[ref] = label
        self.ref_of[label] = ref
        self.trace.arrive(label, ref.n_tokens, content_key or ref.chunk_id[:16], modality=trace_modality,
                          at=self._placed_at(ref))
        return ref

    def _placed_at(self, ref: ChunkRef) -> int | None:
        """Where the window put ``ref`` (None: at the end), for the trace."""
        i = list(self.window.refs).index(ref)
        return None if i == len(self.window.refs) - 1 else i

    def recall(self, label: str, at: int | None = None) -> Receipt:
        ref = self.ref_of[label]
        rc = self._account(self.window.recall(ref, at="end" if at is None else at))  # where the agent says (expect's)
        self._left(rc)
        self.trace.recall(label, at=self._placed_at(ref))
        return rc

    def evict(self, label: str) -> Receipt:
        rc = self._account(self.window.evict(self.ref_of[label]))
        self.trace.evict(label)
        return rc

    def reorder(self, labels: Sequence[str]) -> Receipt:
        rc = self._account(self.window.reorder([self.ref_of[x] for x in labels]))
        self.trace.reorder(list(labels))
        return rc

    def slide(self, n: int = 1) -> Receipt:
        rc = self._account(self.window.slide(n))
        self.trace.slide(n)
        return rc

    def is_disposable(self, label: str, question: str, *, max_new_tokens: int = 4, drop: bool = True) -> Any:
        """The model decides: does ``question``'s answer change without ``label``'s conditioning
        (and without the chunk)? A ``Verdict``; its decodes count in the step."""
        v = self.window.is_disposable(self.ref_of[label], query_ids(self.backend, question),
                                      max_new_tokens=max_new_tokens, drop=drop, chat=False)
        self._account(v.receipt)
        return v

    def in_window(self, label: str) -> bool:
        ref = self.ref_of.get(label)
        return ref is not None and ref in self.window

    @property
    def labels(self) -> list[str]:
        return [self.label_of[r] for r in self.window.refs]

    # ------------------------------------------------------------------ the query
    def ask(self, question: str, *, max_new_tokens: int | None = None, choices: Sequence[str] | None = None) -> Step:
        """Answer ``question`` from the window as it stands; measures (``config.measure``) KL and
        time to first token against a full re-prefill, and what a prefix cache would prefill.

        ``choices``: the model picks one of these (the one whose first token it ranks highest
        after the question) instead of generating free text."""
        st = self._need_step()
        q = query_ids(self.backend, question)
        st.question = question
        ops_ms = (time.perf_counter() - self._t0) * 1000.0
        stream = window_stream(self.window) + [("query", t) for t in q]
        st.reprefill_tokens = len(stream)
        st.prefix_cache_tokens = len(stream) - common_prefix(self._last_query_stream, stream)
        self._last_query_stream = stream
        st.tokens_prefilled += len(q)
        st.forwards += 1
        _phase("window")
        mine = window_first_token(self.window, q)
        st.ms = ops_ms + mine.ms
        if self.config.measure:
            _phase("re-prefill")
            ref = reprefill_first_token(self.window, q)
            st.reprefill_ms = ref.ms
            st.kl = kl_divergence(ref.logits, mine.logits)
            st.same_next_token = int(ref.logits.argmax()) == int(mine.logits.argmax())
        if choices:
            st.choice = True
            st.answer = pick_choice(self.backend, mine.logits, choices)
            n_out = 1
        else:
            _phase("answer")
            answer = self.window.generate(q, max_new_tokens=max_new_tokens or self.config.max_new_tokens, chat=False)
            st.answer = (answer.text or "").strip()
            n_out = len(answer.token_ids)
        _phase("done")
        self.trace.query(tokens=len(q), output_tokens=n_out, text=question, answer=st.answer)
        return st

    # ------------------------------------------------------------------ results
    def summary(self) -> dict[str, Any]:
        """Totals over the run (see the module docstring for what each side counts)."""
        queries = [s for s in self.steps if s.question is not None]
        healed = Counters.summed(self.idle_heals)
        work = Counters.summed([*self.steps, *self.idle_heals])  # idle-time work counts too
        cd_tokens = work.tokens_prefilled
        rp_tokens = sum(s.reprefill_tokens or 0 for s in queries)
        pc_tokens = sum(s.prefix_cache_tokens or 0 for s in queries)
        kls = [s.kl for s in queries if s.kl is not None]
        ratios = [s.reprefill_ms / s.ms for s in queries if s.reprefill_ms and s.ms > 0]
        agree = [s.same_next_token for s in queries if s.same_next_token is not None]
        out: dict[str, Any] = {
            "steps": len(self.steps),
            "queries": len(queries),
            "forwards": work.forwards,
            "encodes": work.encodes,
            "tokens_prefilled": cd_tokens,
            "idle_heal": {"heals": len(self.idle_heals), "forwards": healed.forwards,
                          "tokens": healed.tokens_prefilled, "ms": round(sum(r.wall_ms for r in self.idle_heals), 2)},
            "reprefill_tokens": rp_tokens,
            "prefix_cache_tokens": pc_tokens,
            "prefill_avoided_vs_reprefill": None if not rp_tokens else 1.0 - cd_tokens / rp_tokens,
            "prefill_avoided_vs_prefix_cache": None if not pc_tokens else 1.0 - cd_tokens / pc_tokens,
            "query_tokens_prefilled": sum(s.tokens for s in queries),
            "ttft_ms": [round(s.ms, 2) for s in queries],
            "reprefill_ttft_ms": [None if s.reprefill_ms is None else round(s.reprefill_ms, 2) for s in queries],
            "ttft_speedup_median": _median(ratios),
            "kl": kls,
            "kl_max": max(kls) if kls else None,
            "kl_median": _median(kls),
            "same_next_token": None if not agree else {"calls": len(agree), "same": sum(agree)},
            # chunks read once vs re-read (a recall): a first read costs the same in every scheme
            "appended": sum(1 for s in self.steps for r in s.receipts if r.op == "append"),
            "recalled": sum(len(r.refs) for s in self.steps for r in s.receipts if r.op == "recall"),
            "rereads": self.rereads(),
            "answers": [{"question": s.question, "answer": s.answer, "kl": s.kl} for s in queries if not s.choice],
            "question_kl": [s.kl for s in queries if not s.choice and s.kl is not None],
            "window_budget_tokens": self.config.budget_tokens,
            "patch_policy": getattr(self.window.policy, "name", str(self.config.patch_policy)),
            "rank": self.config.rank,
        }
        return out

    def rereads(self) -> dict[str, Any]:
        """How the run's re-reads (recalls) were served: ``recalls`` (chunks), ``forwards`` run
        on the critical path by the recall operations, and ``served``: per chunk the recall
        re-instated, what it got (``Receipt.served``: ``anticipated`` / ``recurring`` / ``orbit`` —
        prepared before the step —, ``fresh`` — formed in the step —, ``stale``, ``blind``, ...)."""
        recalls = [r for s in self.steps for r in s.receipts if r.op == "recall"]
        served: dict[str, int] = {}
        for r in recalls:
            what = dict(r.served)
            for ref in r.refs:
                key = what.get(ref, "canonical")  # nothing in front: its canonical, exact
                served[key] = served.get(key, 0) + 1
        return {"recalls": sum(len(r.refs) for r in recalls), "forwards": sum(r.forwards for r in recalls),
                "served": served}

    def write_trace(self, path: str | Path) -> Path:
        """Write the recorded trace (validated whole first, as replay reads it)."""
        trace = self.trace.build()
        return write_trace(path, trace.header, trace.events)


def pick_choice(backend: Any, logits: Any, choices: Sequence[str]) -> str:
    """The choice whose first token (any of its spellings: as is, capitalized, after a space)
    has the highest next-token logit."""
    best, best_v = choices[0], float("-inf")
    for c in choices:
        ids = {backend.tokenize(v)[0] for v in (c, c.capitalize(), " " + c, " " + c.capitalize()) if backend.tokenize(v)}
        v = max(float(logits[i]) for i in ids)
        if v > best_v:
            best, best_v = c, v
    return best


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def chunk_hash(*parts: object) -> str:
    """A content key for a trace's ``arrive`` (same content, same key)."""
    return content_hash(*parts)


__all__ = ["AgentConfig", "AgentRun", "Step", "query_ids", "chunk_hash", "pick_choice", "phase_listener"]
