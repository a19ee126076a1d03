"""The serving engine: one model worker thread with a bounded queue, the sessions (one
`MessageWindow` each, LRU under a memory budget), the shared store, and the metrics.

Everything that touches the model or a window runs on the worker thread, one request at a
time; HTTP handlers only enqueue (`Engine.submit`, refused with `QueueFull` when the queue is
full) and wait.

Healing in idle time: under a latency-first patch policy (``SERVE_POLICY``, ``"latency-shared"``: every
canonical computed while healing, so replicas sharing the store reuse each other's work) a request
runs no forward it can avoid (new content costs one prefix-cache-style forward; re-read content
is served from the store's patches, a stale patch or its blind canonical) and queues the
conditioning it skipped. A server has idle time between requests: when the queue has been empty
for ``heal_idle_ms``, the worker heals the sessions' windows one step at a time
(``ContextWindow.heal``), most recently used session first, and gives way at the next decoder
layer as soon as a request arrives (the step is one window transaction, so an interrupted step
leaves the window as it was). Once nothing is left to heal, the same idle time prepares what a
session's next request likely needs (``MessageWindow.idle``, anticipation: messages the last
request dropped coming back, the window's likeliest re-reads), once per change of its window.
What healing computes (canonicals, patches) goes to the store, so other replicas sharing it
find them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..core.counters import Counters
from ..core.errors import AgentInputError, WindowTypeError
from ..core.cooperative import Interrupted, background, install_layer_checkpoints
from ..stores import TierTraffic
from ..window import decode
from ..window.config import WindowConfig
from ..session import MessageWindow, normalize_messages
from .compat import template_supports_tools
from .conversation import Prompt, check_budget, parse_prompt, prefix_digests, turns_digest
from .metrics import ServeMetrics

SERVE_POLICY = "latency-shared"
"""The server's default patch policy: latency-first, with every canonical computed while healing
(``window/policy_latency_shared.py``): what one replica encodes, the others find in the store."""


def serve_config(**settings: Any) -> WindowConfig:
    """The settings of a served session's window: ``SERVE_POLICY`` and the defaults, with
    ``settings`` on top (a ``MessageWindow`` keeps the whole list: ``overflow`` is ``"error"``)."""
    return WindowConfig(**{"patch_policy": SERVE_POLICY, **settings, "overflow": "error"})

log = logging.getLogger("contextdeque.serve")


class QueueFull(Exception):
    """The worker's queue is full (the HTTP layer answers 429)."""


@dataclass
class Session:
    """A conversation held in memory, with its id and recency."""

    id: str
    conversation: MessageWindow
    digest: str | None = None  # digest of the messages the window holds + the last reply
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False
    heal_stuck: bool = False  # a heal step made no progress: not healed again until its next request


@dataclass
class GenerationRequest:
    """One chat completion to run (already validated by the HTTP layer)."""

    messages: list[Any]  # as the client sent them (dicts)
    max_new_tokens: int
    session_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    on_text: Callable[[str], None] | None = None  # streaming: called with each text delta
    on_session: Callable[[str], None] | None = None  # called with the session id once the worker chose it
    enqueued: float = field(default_factory=time.perf_counter)
    prompt: Prompt | None = None  # set by Engine.submit


@dataclass
class GenerationResult(Counters):
    """One request's reply and what it cost: the window's work (:class:`Counters`: its sync's and
    decode's receipts added, plus the generation prompt's tokens) and the store's fallbacks."""

    text: str
    token_ids: list[int]
    finish_reason: str
    session_id: str
    prompt_tokens: int
    fallbacks: dict[str, int]
    ttft_s: float | None
    restored: bool
    fidelity_misses: list[dict[str, Any]] = field(default_factory=list)  # FidelityMiss.as_dict() of this request's ops

    def usage_extra(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "tokens_prefilled": self.tokens_prefilled,
            "prefill_avoided": self.prompt_tokens - self.tokens_prefilled,
            "encodes": self.encodes,
            "patches_formed": self.patches_formed,
            "patches_reused": self.patches_reused,
            "store_fallbacks": self.fallbacks,
            "restored": self.restored,
            "fidelity_misses": self.fidelity_misses,
        }


class _Streamer:
    """A transformers streamer: text deltas of the new tokens to ``on_text``; stops on a stop
    string (via `should_stop`). The first ``put`` is the prompt and is skipped."""

    def __init__(self, tokenizer: Any, on_text: Callable[[str], None] | None, stop: Sequence[str], t0: float) -> None:
        self.tok = tokenizer
        self.on_text = on_text
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = ""
        self.prompt_seen = False
        self.t0 = t0
        self.first_token_s: float | None = None
        self.stopped = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.t0
        self.ids.extend(int(x) for x in value.reshape(-1).tolist())
        self._emit(final=False)

    def end(self) -> None:
        self._emit(final=True)

    def text(self) -> str:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            i = text.find(s)
            if i >= 0:
                text = text[:i]
                self.stopped = True
        return text

    def _emit(self, final: bool) -> None:
        text = self.text()
        if not final and text.endswith("\ufffd"):
            return  # half of a multi-byte character: wait for the rest
        # while a stop string may be forming at the end, hold back its possible prefix
        hold = 0 if final or self.stopped else max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        ready = text[: len(text) - hold]
        if ready.startswith(self.sent) and len(ready) > len(self.sent):
            if self.on_text is not None:
                self.on_text(ready[len(self.sent):])
            self.sent = ready

    def should_stop(self) -> bool:
        return bool(self.stop) and self.stopped


class _StopOnString:
    """``stopping_criteria`` entry: stop as soon as the streamer has seen a stop string."""

    def __init__(self, streamer: _Streamer) -> None:
        self.streamer = streamer

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> torch.Tensor:
        self.streamer.text()
        return torch.full((input_ids.shape[0],), self.streamer.should_stop(), dtype=torch.bool, device=input_ids.device)


class Engine:
    """Model, store, sessions and the worker.

    Args:
        backend: ``HFBackend`` with a chat-template tokenizer.
        store: the ``TieredStore`` all sessions share (local tiers, optionally a Valkey tier).
        model_name: the name clients use (``GET /v1/models``).
        config: every session's window settings, one ``WindowConfig`` (default:
            :func:`serve_config`: the ``SERVE_POLICY`` and the default rank); a ``fidelity_target``
            in it counts its misses in the metrics and lists them in each response's usage.
        context_tokens: most tokens one request may need (default: the model's maximum positions).
        max_tokens: default and ceiling of ``max_tokens`` per request.
        queue_size: requests waiting for the worker beyond the running one; more get 429.
        session_memory_bytes: budget of the sessions' window pages; least recently used
            sessions are closed beyond it (their chunks stay in the store: a later request with
            the same messages restores the window without forwards).
        plain: the baseline: no windows, every request re-prefills its whole prompt (one
            ``model.generate`` over root + messages + generation prompt).
        heal_idle_ms: heal the sessions' windows once the queue has been empty this long (None:
            never). Only a latency-first policy leaves anything to heal.
        processor: a Qwen-VL backend's image processor: image parts of messages go through its
            vision tower (once per distinct picture: the store keeps the tower's output). None:
            image parts are refused (400).
    """

    def __init__(
        self,
        backend: Any,
        store: Any,
        *,
        model_name: str,
        config: WindowConfig | None = None,
        context_tokens: int | None = None,
        max_tokens: int = 256,
        queue_size: int = 16,
        session_memory_bytes: int = 1 << 30,
        metrics: ServeMetrics | None = None,
        plain: bool = False,
        heal_idle_ms: float | None = 20.0,
        processor: Any = None,
    ) -> None:
        self.backend = backend
        self.config = serve_config() if config is None else config
        if not isinstance(self.config, WindowConfig):
            raise WindowTypeError(f"config must be a WindowConfig, got {type(self.config).__name__}")
        self.store = store
        self.model_name = model_name
        self.processor = processor
        # the template MessageWindow cuts with (image parts wrapped in the model's vision tokens)
        self.template = MessageWindow(backend, processor=processor).template
        self.tools_supported = template_supports_tools(backend.tokenizer)
        cfg = getattr(backend.model, "config", None)
        self.context_tokens = context_tokens or int(getattr(getattr(cfg, "get_text_config", lambda: cfg)(), "max_position_embeddings", 2048))
        self.max_tokens = max_tokens
        self.kv_bytes_per_token = backend.layout.kv_channels * 4
        self.session_memory_bytes = session_memory_bytes
        self.plain = plain
        if heal_idle_ms is not None and (not isinstance(heal_idle_ms, (int, float)) or heal_idle_ms < 0):
            raise ValueError(f"heal_idle_ms must be a number >= 0 or None, got {heal_idle_ms!r}")
        self.heal_idle_ms = None if plain or heal_idle_ms is None else float(heal_idle_ms)
        self._closing = threading.Event()
        # a request arriving interrupts a heal step at the next decoder layer
        self._remove_checkpoints = install_layer_checkpoints(backend.model) if self.heal_idle_ms is not None else None
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self._by_digest: dict[str, str] = {}
        self._lock = threading.Lock()
        self.metrics = metrics or ServeMetrics(self)
        self._queue: queue.Queue[tuple[GenerationRequest, Future] | None] = queue.Queue(maxsize=max(1, queue_size))
        self._thread = threading.Thread(target=self._run, name="contextdeque-model-worker", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public

    def submit(self, req: GenerationRequest) -> Future:
        """Queue ``req`` for the worker; a Future of `GenerationResult`.

        Raises:
            QueueFull: the queue is full.
            BudgetError: the conversation cannot fit the served context (checked before queueing).
            AgentInputError: malformed messages (``MessageFormatError``...), checked before queueing.
        """
        req.prompt = parse_prompt(self.template, req.messages, self.processor)
        if self.plain and req.prompt.has_images:
            raise AgentInputError("the --plain baseline re-prefills text only; image parts are served with windows")
        check_budget(req.prompt, req.max_new_tokens, self.context_tokens)
        fut: Future = Future()
        try:
            self._queue.put_nowait((req, fut))
        except queue.Full:
            raise QueueFull(f"the model worker's queue is full ({self._queue.maxsize} waiting)") from None
        self.metrics.queue_depth.set(self._queue.qsize())
        return fut

    def queue_depth(self) -> int:
        return self._queue.qsize()

    def pending_chunks(self, *, healable: bool = False) -> int:
        """Chunks the sessions' windows hold that a latency-first policy left to heal
        (``healable``: only in sessions the worker would heal now)."""
        with self._lock:
            return sum(len(_pending(s.conversation)) for s in self.sessions.values() if not (healable and s.heal_stuck))

    def idle_sessions(self) -> int:
        """Sessions the worker would give idle time now (something to heal or to anticipate)."""
        with self._lock:
            return sum(1 for s in self.sessions.values() if not s.heal_stuck and s.conversation.idle_work)

    def close(self) -> None:
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout=30)
        if self._remove_checkpoints is not None:
            self._remove_checkpoints()
        with self._lock:
            for s in self.sessions.values():
                s.conversation.close()
            self.sessions.clear()

    def session_bytes(self) -> int:
        with self._lock:
            return self.session_bytes_locked()

    # ------------------------------------------------------------------ worker

    def _next(self) -> tuple[GenerationRequest, Future] | None:
        """The next queued item; while none comes, heal (when healing is on)."""
        if self.heal_idle_ms is None:
            return self._queue.get()
        while True:
            try:
                return self._queue.get(timeout=self.heal_idle_ms / 1000.0)
            except queue.Empty:
                pass
            while self._queue.empty() and not self._closing.is_set() and self._heal_step():
                pass
            if self.idle_sessions() == 0:
                return self._queue.get()  # nothing to heal or prepare until a request comes

    def _heal_step(self) -> bool:
        """One idle step (heal, else anticipation) of the most recently used session with work for
        it (worker thread). False when no session has any. A session whose step fails or makes no
        progress is left as served until its next request (never a busy loop)."""
        with self._lock:
            session = next((s for s in reversed(self.sessions.values()) if not s.heal_stuck and s.conversation.idle_work), None)
        if session is None:
            return False
        window = session.conversation.window
        assert window is not None
        before = len(window.pending_refs)
        t0 = time.perf_counter()
        try:
            with background(lambda: not self._queue.empty() or self._closing.is_set()):
                rec = session.conversation.idle(max_steps=1)
        except Interrupted:
            self.metrics.heal_interrupted.inc()
            return True
        except Exception:  # noqa: BLE001 - the step was one transaction: the window is unchanged
            log.exception("heal step failed (session %s); left as served until its next request", session.id)
            self.metrics.heal_errors.inc()
            session.heal_stuck = True
            return True
        assert rec is not None
        step = window.last_receipt if window.last_receipt is not None and window.last_receipt.op in ("heal", "anticipate") else None
        if rec.refs:
            self.metrics.record_heal(rec, step, time.perf_counter() - t0)
        if before and len(window.pending_refs) >= before:  # never spin on a window that does not heal
            log.warning("heal step made no progress (session %s, %d pending); left until its next request", session.id, before)
            session.heal_stuck = True
        return True

    def _run(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            req, fut = item
            self.metrics.queue_depth.set(self._queue.qsize())
            self.metrics.queue_wait.observe(time.perf_counter() - req.enqueued)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self._generate(req))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting request
                fut.set_exception(e)

    def _session_for(self, req: GenerationRequest) -> tuple[Session, bool]:
        """The session to serve ``req``: by id, else the one whose history the request extends."""
        with self._lock:
            if req.session_id is not None:
                s = self.sessions.get(req.session_id)
                if s is not None and not s.busy:
                    self.sessions.move_to_end(s.id)
                    return s, False
                sid = req.session_id
            else:
                sid = None
                assert req.prompt is not None
                for d in reversed(prefix_digests([m.key for m in req.prompt.messages])):
                    cand = self.sessions.get(self._by_digest.get(d, ""))
                    if cand is not None and not cand.busy:
                        self.sessions.move_to_end(cand.id)
                        return cand, False
            conv = MessageWindow(self.backend, self.config, store=self.store, processor=self.processor)
            s = Session(sid or uuid.uuid4().hex, conv)
            old = self.sessions.pop(s.id, None)
            if old is not None:
                old.conversation.close()
            self.sessions[s.id] = s
            return s, True

    def _evict_sessions(self, keep: str) -> None:
        with self._lock:
            while len(self.sessions) > 1 and self.session_bytes_locked() > self.session_memory_bytes:
                victim = next((s for s in self.sessions.values() if s.id != keep and not s.busy), None)
                if victim is None:
                    break
                del self.sessions[victim.id]
                if victim.digest is not None:
                    self._by_digest.pop(victim.digest, None)
                victim.conversation.close()
                self.metrics.sessions_evicted.inc()

    def session_bytes_locked(self) -> int:
        return sum(_tokens(s.conversation) for s in self.sessions.values()) * self.kv_bytes_per_token

    def _sampling(self, req: GenerationRequest, streamer: "_Streamer") -> dict[str, Any]:
        kw: dict[str, Any] = {"streamer": streamer}
        if req.stop:
            kw["stopping_criteria"] = [_StopOnString(streamer)]
        if req.temperature is not None and req.temperature > 0:
            kw.update(do_sample=True, temperature=float(req.temperature))
            if req.top_p is not None:
                kw["top_p"] = float(req.top_p)
            if req.seed is not None:
                torch.manual_seed(int(req.seed))
        return kw

    def _finish(self, streamer: "_Streamer", ids: list[int], eos: set[int], max_new: int) -> tuple[str, str]:
        text = streamer.text()
        streamer.end()
        finish = "stop" if streamer.stopped or (ids and ids[-1] in eos) else ("length" if len(ids) >= max_new else "stop")
        return text, finish

    def _generate_plain(self, req: GenerationRequest, t0: float) -> GenerationResult:
        prompt = req.prompt or parse_prompt(self.template, req.messages, self.processor)
        ids = torch.tensor([prompt.ids()], dtype=torch.long, device=self.backend.device)
        streamer = _Streamer(self.backend.tokenizer, req.on_text, req.stop, t0)
        eos = _eos(self.backend)
        with torch.no_grad():
            out = self.backend.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=req.max_new_tokens,
                do_sample=False, pad_token_id=min(eos) if eos else 0, **self._sampling(req, streamer),
            )
        new_ids = [int(t) for t in out[0, ids.shape[1]:].tolist()]
        text, finish = self._finish(streamer, new_ids, eos, req.max_new_tokens)
        result = GenerationResult(
            text=text, token_ids=new_ids, finish_reason=finish, session_id="plain", prompt_tokens=prompt.prompt_tokens,
            tokens_prefilled=prompt.prompt_tokens, fallbacks={},
            ttft_s=streamer.first_token_s, restored=False,
        )
        self.metrics.record(result, [], time.perf_counter() - t0)
        return result

    def _generate(self, req: GenerationRequest) -> GenerationResult:
        t0 = time.perf_counter()
        if self.plain:
            if req.on_session is not None:
                req.on_session("plain")
            return self._generate_plain(req, t0)
        session, new = self._session_for(req)
        session.busy = True
        try:
            if req.on_session is not None:
                req.on_session(session.id)
            mw = session.conversation
            prompt = req.prompt or parse_prompt(self.template, req.messages, self.processor)
            rec = mw.sync(list(prompt.raw))  # a transaction: a failure leaves the window as it was
            streamer = _Streamer(self.backend.tokenizer, req.on_text, req.stop, t0)
            answer = mw.generate(req.max_new_tokens, **self._sampling(req, streamer))
            ids = list(answer.token_ids)
            assert mw.window is not None
            text, finish = self._finish(streamer, ids, set(decode.eos_ids(mw.window.context)), req.max_new_tokens)
            receipts = [*(o.receipt for o in rec.ops), answer.receipt]
            work = rec.counters
            result = GenerationResult(
                text=text, token_ids=ids, finish_reason=finish, session_id=session.id,
                prompt_tokens=prompt.prompt_tokens,
                **{**work.counts(), "tokens_prefilled": work.tokens_prefilled + len(prompt.cut.generation_ids)},
                fallbacks=TierTraffic.summed(r.traffic for r in receipts).fallbacks, ttft_s=streamer.first_token_s,
                restored=new and rec.appended > 0 and rec.encodes == 0,
                fidelity_misses=[m.as_dict() for r in receipts for m in r.fidelity_misses],
            )
            reply_key = normalize_messages([{"role": "assistant", "content": text}])[0].key
            with self._lock:
                if session.digest is not None:
                    self._by_digest.pop(session.digest, None)
                session.digest = turns_digest([*(m.key for m in prompt.messages), reply_key])
                self._by_digest[session.digest] = session.id
                session.last_used = time.monotonic()
            self.metrics.record(result, receipts, time.perf_counter() - t0)
            return result
        finally:
            session.busy = False
            session.heal_stuck = False
            self._evict_sessions(keep=session.id)


def _eos(backend: Any) -> set[int]:
    """End-of-sequence ids of a backend (the window's own rule, without a window)."""
    from types import SimpleNamespace

    return set(decode.eos_ids(SimpleNamespace(backend=backend)))


def _pending(mw: MessageWindow) -> tuple[Any, ...]:
    w = mw.window
    return () if w is None or w.closed else w.pending_refs


def _tokens(mw: MessageWindow) -> int:
    """Tokens a session's window holds (root + messages)."""
    w = mw.window
    return 0 if w is None or w.closed else len(w.root_ids) + w.tokens_used
