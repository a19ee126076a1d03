"""MessageWindow: a context window kept in step with an OpenAI-style chat-messages list.

Agent frameworks keep their context as a list of chat messages (system / user / assistant /
tool; text and image parts) and hand the whole list to the model at every call. ``MessageWindow``
turns each call's list into cache edits instead of a re-prefill::

    from contextdeque.session import MessageWindow
    mw = MessageWindow(backend)                      # settings: a WindowConfig (or its fields), and a store
    receipt = mw.sync(messages)                      # diff against the last list -> window operations
    print(receipt.summary())                         # what it cost, vs a re-prefill and a prefix cache
    answer = mw.generate(max_new_tokens=64)          # the assistant's reply (greedy by default)

How a list becomes the window (the model's own chat template decides every token):

- The **root** is what the template renders before the first conversational message: the system
  message (or, without one, the template's implicit header). A different system prompt is a
  different root: the window is rebuilt (``SyncReceipt.rebuilt``).
- Every other message is **one chunk** (its role header, content and end-of-turn, exactly as the
  template renders it); a message with image parts is a short run of chunks (text, image span,
  text). Images go through the model's vision tower (Qwen-VL, with ``processor=``; the store keeps
  the tower's output) or, on a text-only model, through the documented image-span emulation
  (``contextdeque.model.images``: no visual understanding).
- The **generation prompt** (the assistant header) is the query ``generate`` decodes after them.

The concatenation is checked against the template applied to the whole list, string and tokens
(``TemplateError`` if the template does not render incrementally). So under the ``exact`` patch
policy the materialized window equals a re-prefill of the templated list (to float rounding).

``sync`` matches messages by content (role + content + tool calls + image pixels):

=====================  ==============================================  ==========================
the new list has       window operation                                 forwards
=====================  ==============================================  ==========================
the same messages      nothing                                          0
new ones at the end    ``append`` (encode once, patch on what precedes) <= 2 per chunk
one left out           ``evict`` (recallable; later chunks survive)     0 (default policy)
one back that left     ``recall`` (canonical + fresh patch, never       <= 1 per chunk, 0 encodes
                       re-encoded; counted in ``SyncReceipt.returned``)
an edited one          the old version is evicted, the new one is a     as append
                       new chunk
a permutation          ``reorder`` (orbit patches where they exist)     0+
=====================  ==============================================  ==========================

A new message in the middle is placed by evicting the chunks after it, appending it, and
recalling them behind it (each gets a fresh patch on its new antecedents). ``sync`` is a
transaction: it runs on a fork of the window and commits only if every step succeeded; a
malformed list, a template problem or an exceeded budget raises a typed error and leaves the
window and the ``MessageWindow`` as they were.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import torch

from contextdeque.core.errors import WindowError, WindowTypeError
from contextdeque.core.metrics import kl_divergence
from contextdeque.model.images import DEFAULT_IMAGE_TOKENS, ImagePath, pixel_digest
from contextdeque.window import Answer, ChunkRef, ContextWindow, Receipt, WindowConfig

from .measure import FirstToken, common_prefix, reprefill_first_token, window_first_token
from .messages import ROLES, ChatMessage, normalize_messages
from .receipt import MessageOp, SyncReceipt
from .template import ChatTemplate, TemplateCut


@dataclass
class _Entry:
    """A message's place in the window: its key, role and chunk refs."""

    key: str
    role: str
    refs: tuple[ChunkRef, ...]


# ---------------------------------------------------------------------------- the adapter


class MessageWindow:
    """A ``ContextWindow`` kept in step with a chat-messages list.

    Args:
        backend: an ``HFBackend`` whose tokenizer has a chat template (``contextdeque.load_model()``).
        config: the window's settings, one ``WindowConfig`` (default: the defaults, ``overflow="error"``:
            a list beyond ``budget_tokens`` makes ``sync`` raise ``BudgetError``; trimming history
            is the caller's choice, not ours). ``settings``: ``WindowConfig`` fields set on top of it
            (``budget_tokens=``, ``rank=``, ``patch_policy=``: ``"default"``, ``"exact"`` (full-rank:
            equals a re-prefill), ``"none"``, another registered name or a ``PatchPolicy``...).
        store: the store canonicals and patches live in; share one between MessageWindows (or
            processes, with a disk or Valkey tier) to share what was encoded.
        processor: a Qwen-VL model's image processor (image parts go through its vision tower);
            without one, a text-only model takes image parts through the image-span emulation.
        image_tokens: most tokens an emulated image span takes.
        tokenizer: the tokenizer with the chat template (default: the backend's).
        max_evicted: messages kept recallable after they leave the list (oldest forgotten first).
        Idle time between requests (:meth:`idle`; ``serve`` runs it) also prepares what the next
        request likely brings back (``config.anticipate``, on by default): the messages the last
        sync dropped, back where they stood (``ContextWindow.expect``), and the window's likeliest
        re-reads, so such a request runs no forward on the critical path.
    """

    def __init__(self, backend: Any, config: WindowConfig | None = None, *, store: Any = None, processor: Any = None,
                 image_tokens: int = DEFAULT_IMAGE_TOKENS, tokenizer: Any = None, max_evicted: int = 256,
                 **settings: Any) -> None:
        if config is not None and not isinstance(config, WindowConfig):
            raise WindowTypeError(f"config must be a WindowConfig, got {type(config).__name__}")
        config = WindowConfig(**{"overflow": "error", **settings}) if config is None else config.replace(**settings)
        if config.overflow != "error":
            raise WindowError("MessageWindow keeps the whole list: overflow must be 'error'")
        self.config = config
        self.backend = backend
        self.images = ImagePath(backend, processor=processor, max_tokens=image_tokens)
        wrap: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        if processor is not None:
            cfg = backend.model.config
            wrap = ((int(cfg.vision_start_token_id),), (int(cfg.vision_end_token_id),))
        self.template = ChatTemplate(tokenizer if tokenizer is not None else backend.tokenizer, image_wrap=wrap)
        self.store = store
        self.max_evicted = int(max_evicted)
        self.window: ContextWindow | None = None
        self.messages: tuple[ChatMessage, ...] = ()
        self.cut: TemplateCut | None = None
        self.receipts: deque[SyncReceipt] = deque(maxlen=1000)
        self.stats: dict[str, int] = defaultdict(int)
        self._live: list[_Entry] = []
        self._gone: dict[str, list[_Entry]] = {}
        self._gone_order: deque[_Entry] = deque()
        self._stream: list[Hashable] = []
        self._image_tokens: dict[str, int] = {}

    # ------------------------------------------------------------------ introspection
    @property
    def root_ids(self) -> tuple[int, ...]:
        return () if self.window is None else tuple(self.window.root_ids)

    @property
    def generation_ids(self) -> tuple[int, ...]:
        """The generation prompt (assistant header) ``generate`` decodes after the window."""
        if self.cut is None:
            raise WindowError("sync a messages list first")
        return self.cut.generation_ids

    def refs_of(self, index: int) -> tuple[ChunkRef, ...]:
        """The window refs of message ``index`` of the last synced list (empty for the root's
        system message)."""
        if self.cut is None:
            raise WindowError("sync a messages list first")
        if index < self.cut.first:
            return ()
        return self._live[index - self.cut.first].refs

    def template_ids(self, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the template applied to the whole last-synced list (text-only lists: what a
        plain server prefills for this request)."""
        if self.cut is None:
            raise WindowError("sync a messages list first")
        if any(m.images for m in self.messages):
            raise WindowError("the list holds images: its prompt is not token ids alone")
        ids = list(self.cut.root_ids)
        for run in self.cut.pieces:
            for pc in run:
                ids.extend(pc)  # type: ignore[arg-type]
        return ids + (list(self.cut.generation_ids) if add_generation_prompt else [])

    def __repr__(self) -> str:
        return f"MessageWindow({len(self.messages)} messages, {self.window!r})"

    # ------------------------------------------------------------------ sync
    def sync(self, messages: Any) -> SyncReceipt:
        """Bring the window in step with ``messages`` (the whole current list). Returns what it did.

        Raises:
            MessageFormatError / MessageTypeError: a malformed list (nothing changed).
            MediaError: an unreadable image part (``UnsupportedMediaError`` for its mode).
            TemplateError: the chat template cannot be cut per message.
            BudgetError: the list does not fit ``budget_tokens``.
        """
        t0 = time.perf_counter()
        msgs = normalize_messages(messages)
        cut = self.template.cut(msgs)
        rec = SyncReceipt(messages=len(msgs))
        window, live, gone = self.window, list(self._live), {k: list(v) for k, v in self._gone.items()}
        fresh = window is None or tuple(window.root_ids) != cut.root_ids
        if fresh:
            window = ContextWindow.from_config(self.backend, self.config, root=list(cut.root_ids), store=self._shared_store())
            live, gone = [], {}
            rec.rebuilt = self.window is not None
        assert window is not None
        body = msgs[cut.first :]
        plan = self._plan(body, live, gone)
        child = window.fork()
        try:
            new_live, left = self._apply(child, body, cut, plan, live, rec)
            if [r for e in new_live for r in e.refs] != list(child.refs):
                raise WindowError("internal: the window's order does not match the messages after sync")
            child.commit()
        except BaseException:
            child.discard()
            if fresh:
                window.close()
            raise
        # committed: install the new state
        if fresh and self.window is not None:
            self.window.close()
        self.window = window
        for e in left:
            gone.setdefault(e.key, []).append(e)
        self._expect_back(window, left, live)
        self._live, self._gone = new_live, gone
        if fresh:
            self._gone_order.clear()
        self._gone_order.extend(left)
        self._forget_old()
        self.messages, self.cut = tuple(msgs), cut
        stream = cut.stream(msgs, self._image_tokens)
        rec.reprefill_tokens = len(stream)
        rec.prefix_cache_tokens = len(stream) - common_prefix(self._stream, stream)
        self._stream = stream
        rec.wall_ms = (time.perf_counter() - t0) * 1000.0
        self.receipts.append(rec)
        for k in ("appended", "evicted", "returned", "moved"):
            self.stats[k] += getattr(rec, k)
        self.stats["syncs"] += 1
        self.stats["reorders"] += int(rec.reordered)
        self.stats["rebuilds"] += int(rec.rebuilt)
        self.stats["encodes"] += rec.encodes
        self.stats["returned_encodes"] += rec.returned_encodes
        self.stats["forwards"] += rec.forwards
        self.stats["tokens_prefilled"] += rec.tokens_prefilled
        self.stats["reprefill_tokens"] += rec.reprefill_tokens
        self.stats["prefix_cache_tokens"] += rec.prefix_cache_tokens
        return rec

    @staticmethod
    def _expect_back(window: ContextWindow, left: Sequence[_Entry], before: Sequence[_Entry]) -> None:
        """Say that the messages this sync dropped may come back where they stood (a trimmed
        message restored, an edit undone): the next idle time prepares those recalls."""
        if not window.context.config.anticipate:
            return
        index = 0
        for e in before:
            if any(e is x for x in left) and all(r in window.evicted_refs for r in e.refs):
                window.expect(e.refs, at=index)
            else:
                index += len(e.refs)

    # ------------------------------------------------------------------ idle time
    @property
    def idle_work(self) -> bool:
        """Whether :meth:`idle` has work: conditioning a latency-first policy deferred, or, with
        ``anticipate``, a window that changed since anticipation last ran to completion."""
        w = self.window
        return w is not None and not w.closed and (bool(w.pending_refs) or w.anticipation_due)

    def idle(self, max_ms: float | None = None, *, max_steps: int | None = None) -> Receipt | None:
        """Use idle time between requests (``ContextWindow.heal``): carry out the deferred
        conditioning, then (``anticipate``) prepare what the next request likely needs. Each step
        is one window transaction. Returns the heal's receipt (None before the first sync)."""
        w = self.window
        if w is None or w.closed:
            return None
        return w.heal(max_ms, max_steps=max_steps)

    def _shared_store(self) -> Any:
        """The store every window of this MessageWindow uses (made once, so a rebuilt window still
        finds what earlier ones encoded)."""
        if self.store is None:
            from contextdeque.window import default_store

            self.store = default_store(self.backend.device)
        return self.store

    @staticmethod
    def _plan(body: Sequence[ChatMessage], live: list[_Entry], gone: dict[str, list[_Entry]]) -> list[tuple[str, Any]]:
        """Per message of ``body``: ``("keep", entry)`` (in the window), ``("recall", entry)`` (left
        earlier, comes back) or ``("new", None)``. Equal messages match in order."""
        in_window: dict[str, deque[_Entry]] = defaultdict(deque)
        for e in live:
            in_window[e.key].append(e)
        out: list[tuple[str, Any]] = []
        for m in body:
            if in_window[m.key]:
                out.append(("keep", in_window[m.key].popleft()))
            elif gone.get(m.key):
                out.append(("recall", gone[m.key].pop()))
            else:
                out.append(("new", None))
        return out

    def _apply(
        self,
        win: ContextWindow,
        body: Sequence[ChatMessage],
        cut: TemplateCut,
        plan: list[tuple[str, Any]],
        live: list[_Entry],
        rec: SyncReceipt,
    ) -> tuple[list[_Entry], list[_Entry]]:
        """Run the plan's window operations on ``win`` (a fork). Returns the new entries in window
        order and the entries that left."""
        first = cut.first
        kept_ids = {id(e) for kind, e in plan if kind == "keep"}
        left = [e for e in live if id(e) not in kept_ids]
        # What stays but sits behind a new message (in the new list) steps out and is recalled
        # after it: a new message can only be appended at the end.
        kinds = [k for k, _ in plan]
        first_new = kinds.index("new") if "new" in kinds else len(plan)
        stepped_out = {id(e) for k, e in plan[first_new + 1 :] if k == "keep"}
        # 1. evict what left the list and what steps out, from the end (nothing re-places twice)
        for e in reversed(live):
            if id(e) in stepped_out or id(e) not in kept_ids:
                why = "making room" if id(e) in stepped_out else "edited-or-dropped"
                for r in reversed(e.refs):
                    rec.ops.append(MessageOp("evict", live.index(e) + first, e.role, why, win.evict(r)))
        rec.evicted = len(left)
        # 2. a permutation of what stays in place
        stay_now = [e for e in live if id(e) in kept_ids and id(e) not in stepped_out]
        stay_target = [e for k, e in plan if k == "keep" and id(e) not in stepped_out]
        if [id(e) for e in stay_now] != [id(e) for e in stay_target]:
            rc = win.reorder([r for e in stay_target for r in e.refs])
            rec.ops.append(MessageOp("reorder", None, None, "reordered", rc))
            rec.reordered = True
        # 3. walk the new list: recalls in place, new messages appended
        out: list[_Entry] = []
        idx = 0
        for j, ((kind, entry), m) in enumerate(zip(plan, body)):
            pos = j + first
            if kind == "keep" and id(entry) not in stepped_out:
                rec.kept += 1
                idx += len(entry.refs)
                out.append(entry)
            elif kind in ("keep", "recall"):
                why = "moved" if kind == "keep" else "returned"
                for r in entry.refs:
                    rec.ops.append(MessageOp("recall", pos, entry.role, why, win.recall(r, at=idx)))
                    idx += 1
                setattr(rec, why, getattr(rec, why) + 1)
                out.append(entry)
            else:
                refs = []
                for pc in cut.pieces[j]:
                    refs.append(self._append_piece(win, m, pc))
                    rec.ops.append(MessageOp("append", pos, m.role, "new", refs[-1].receipt))  # type: ignore[arg-type]
                    idx += 1
                rec.appended += 1
                out.append(_Entry(key=m.key, role=m.role, refs=tuple(refs)))
        return out, left

    def _append_piece(self, win: ContextWindow, m: ChatMessage, piece: tuple[int, ...] | int) -> ChunkRef:
        if not isinstance(piece, int):
            return win.append(token_ids=list(piece))
        pixels = m.images[piece]
        ref = win.append(**self.images.append_kwargs(pixels))
        self._image_tokens[pixel_digest(pixels)] = ref.n_tokens
        return ref

    def _forget_old(self) -> None:
        """Purge the oldest recallable messages beyond ``max_evicted``."""
        assert self.window is not None
        live_ids = {id(e) for es in self._gone.values() for e in es}
        order = deque(e for e in self._gone_order if id(e) in live_ids)
        while len(order) > self.max_evicted:
            e = order.popleft()
            self._gone[e.key].remove(e)
            if not self._gone[e.key]:
                del self._gone[e.key]
            for r in e.refs:
                if r in self.window.evicted_refs:
                    self.window.purge(r)
        self._gone_order = order

    # ------------------------------------------------------------------ reading it out
    def _need_window(self) -> ContextWindow:
        if self.window is None or self.cut is None:
            raise WindowError("sync a messages list first")
        return self.window

    def materialize(self) -> Any:
        """The window's KV (root + every message) as a transformers ``DynamicCache``; continue it
        with ``input_ids()`` (text-only lists) or use :meth:`generate`."""
        return self._need_window().materialize()

    def input_ids(self) -> torch.Tensor:
        """``[1, S + G]``: the cached prefix's ids and the generation prompt, for
        ``model.generate(input_ids=mw.input_ids(), past_key_values=mw.materialize())``."""
        return self._need_window().input_ids_for(list(self.generation_ids), chat=False)

    def generate(self, max_new_tokens: int = 64, **kw: Any) -> Answer:
        """The assistant's reply to the synced list (greedy unless ``kw`` says otherwise)."""
        win = self._need_window()
        return win.generate(list(self.generation_ids), max_new_tokens=max_new_tokens, chat=False, **kw)

    def next_token_logits(self) -> FirstToken:
        """Logits of the reply's first token from the window (and how long that took)."""
        return window_first_token(self._need_window(), self.generation_ids)

    def reprefill_logits(self) -> FirstToken:
        """The same from a full re-prefill of the window's contents (the reference)."""
        return reprefill_first_token(self._need_window(), self.generation_ids)

    def fidelity(self) -> dict[str, float]:
        """Next-token KL(re-prefill ‖ window) and both times to first token, measured side by side."""
        ref = self.reprefill_logits()
        got = self.next_token_logits()
        return {"kl": kl_divergence(ref.logits, got.logits), "window_ms": got.ms, "reprefill_ms": ref.ms}

    def close(self) -> None:
        if self.window is not None and not self.window.closed:
            self.window.close()
        self.window = None
        self.cut = None
        self.messages = ()
        self._live, self._gone, self._stream = [], {}, []
        self._gone_order.clear()


__all__ = [
    "MessageWindow",
    "SyncReceipt",
    "MessageOp",
    "ChatMessage",
    "ChatTemplate",
    "TemplateCut",
    "normalize_messages",
    "ROLES",
]
