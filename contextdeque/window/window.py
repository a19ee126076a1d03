"""ContextWindow: an agent's context window as a deque of position-free chunks.

The window holds, after a fixed root, an ordered sequence of slots. Each slot is a chunk's
canonical ``KV(B | root)`` (stored once, content-addressed) plus a conditioning overlay (rank-m
patches restoring what the chunk would have absorbed from the chunks in front of it), placed
at its position by exact RoPE relocation. Operations are cache edits, not re-prefills:

=================  ==============================================================  =========
operation          what happens                                                    forwards
=================  ==============================================================  =========
``append``         canonical from the store (encoded once if new) + a patch on     0-2
                   the antecedents per the patch policy
``slide(n)``       the n oldest leave (recallable); survivors only re-rotate       0 (default)
``reorder``        permute; orbit patch where one exists                           0+
``evict(ref)``     drop the conditioned KV; canonical + patches go one tier down   0
``recall(ref)``    canonical + a *fresh* patch on the new antecedents (never a     <= 1
                   re-encode, never the stale patch); reports the cascade
``fork()``         copy-on-write child sharing canonicals and pages                0, 0 bytes
``is_disposable``  decode with the chunk's conditioning off (and dropped)          decodes
``materialize``    a transformers ``DynamicCache`` of root + pages                 0
``generate``       materialize + decode                                            decodes
=================  ==============================================================  =========

Every operation returns (or, for ``append``, attaches to the returned ref) a :class:`Receipt`;
``window.last_receipt`` is the latest. A failed operation raises a typed error
(``contextdeque.core.errors``) and leaves the window as it was.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Callable, Sequence, TypeVar

import torch

from ..core.chunk import Chunk
from ..core.args import check_instance, check_int, check_str, check_token_ids
from ..core.errors import BudgetError, UnknownRefError, WindowError, WindowTypeError
from ..core.heap import release_freed_heap
from . import budget, decode, ingest
from ..patch.alloc import DEFAULT_ON_MISS
from ..patch.factors import DEFAULT_PATCH_PRECISIONS
from .budget import DEFAULT_BLIND_KL
from .config import DEFAULT_KL_BUDGET_MS, DEFAULT_MAX_EVICTED, DEFAULT_RANK, DEFAULT_RECALL_PLACEMENT, WindowConfig
from .context import WindowContext
from .anticipation import WindowAnticipation
from .anticipate_reorder import note_reorder
from .healing import WindowHealing
from .introspection import WindowIntrospection
from .lifecycle import WindowLifecycle
from .reading import Answer, WindowReading
from .disposable import Verdict
from .graph import Cascade
from .kvselect import SelectionPolicy
from .placement import END, PlacementPolicy, make_placement, placement_reason, recall_chooser, window_index
from .policy import PatchPolicy, make_policy
from .predictor import RecallPredictor
from .receipt import PAGES, Meter, Receipt
from .reconcile import reconcile
from .ref import ChunkRef, new_ref
from .root import backend_with_root
from .slot import Slot
from .state import EvictedEntry, WindowState
from .store import WindowStore

T = TypeVar("T")

BUDGETED_OPS = frozenset({"append", "extend", "slide", "evict", "recall", "reorder", "refresh"})
"""Operations after which ``answer_kl_budget`` checks the arrangement (window.budget)."""


def _same_state(old: WindowState, new: WindowState) -> bool:
    """Whether an operation left the window as it was: the same slot objects in the same order
    (reconcile keeps a slot object whose start and conditioning did not change), the same evicted
    entries and the same pending queue."""
    return (
        len(old.slots) == len(new.slots)
        and all(a is b for a, b in zip(old.slots, new.slots))
        and old.evicted.keys() == new.evicted.keys()
        and all(old.evicted[r] is new.evicted[r] for r in old.evicted)
        and old.pending == new.pending
    )


def check_refs(name: str, refs: Any) -> list[ChunkRef]:
    """``refs`` as a list of ChunkRefs (a sequence of them; anything else is an ArgumentTypeError)."""
    if isinstance(refs, (str, bytes, ChunkRef)) or not isinstance(refs, (Sequence, tuple, list)):
        raise WindowTypeError(f"{name} must be a sequence of ChunkRefs, got {type(refs).__name__}")
    out = list(refs)
    for i, r in enumerate(out):
        check_instance(f"{name}[{i}]", r, ChunkRef, "a ChunkRef")
    return out


class ContextWindow(WindowIntrospection, WindowHealing, WindowAnticipation, WindowLifecycle, WindowReading):
    """A context window of position-free KV chunks over one backend.

    Args:
        backend: an ``HFBackend`` (e.g. ``contextdeque.load_model()``).
        root: the window root (text or token ids); default: the backend's ``root_ids``.
        budget_tokens: most chunk tokens the window holds (the root is not counted); None:
            no budget. When an append or recall would exceed it, the oldest chunks slide out
            (``overflow="slide"``) or ``BudgetError`` is raised (``overflow="error"``).
        rank: the patch rank m (clamped per chunk to ``min(T, H*d)``).
        store: where canonicals and patches live: None (two in-memory tiers, ``device`` and
            ``host``), a ``TieredStore``, a tier, or a list of tiers (fastest first).
        patch_policy: ``"default"`` (``"latency"``: latency-first over ``"eager"``; re-reads
            run no forward, new content one, the deferred patches are formed by :meth:`heal`
            or :meth:`start_healing`), ``"eager"`` (patch on append at rank m, survivors keep
            as-is, every patch formed before the operation returns),
            ``"exact"`` (full-rank patches everywhere: the window equals a re-prefill),
            ``"none"`` (blind), another registered name, or a ``PatchPolicy`` instance.
        cascade_policy: what a recall does to chunks conditioned on the recalled one:
            ``"reform"`` their patches, ``"keep"`` them, or ``"flag"`` them stale.
        overflow: ``"slide"`` or ``"error"`` (see ``budget_tokens``).
        storage: dtype canonicals are stored in (float32, bfloat16, float16).
        placement: where appended and recalled chunks go: ``"arrival"`` (the end, or ``at``),
            ``"scheduler"`` (``contextdeque.scheduler``: the place that keeps stored patches
            valid and forms the fewest new ones), another registered name or a
            ``PlacementPolicy``.
        fidelity_target: an η target (e.g. 0.99: the patch closes 99% of the next-token KL gap
            blind reuse leaves against a re-prefill, on the model's median calibration item).
            When set, each patch gets per-layer K and V ranks allocated from Δ's singular spectra
            where its energy is, as few bytes as capture the energy the model's calibrated
            envelope says the target needs (``contextdeque calibrate --model``; without one the
            target is read as that energy), within ``max_patch_fraction`` of its page's bytes;
            ``rank`` is then not used. See docs/fidelity.md.
        max_patch_fraction: the byte cap of a patch under ``fidelity_target``: its bytes over
            its page's bytes.
        on_miss: what a patch does when the cap cannot fit the target: ``"report"`` (the default:
            keep the best patch within the cap; the receipt's ``fidelity_misses``, ``show()`` and
            the patch's estimated η say so), ``"exceed_budget"`` (take the bytes the target
            needs), ``"recompute"`` (the exact conditioning, every direction).
        patch_precisions: the storage precisions a patch under ``fidelity_target`` may keep a
            direction at (``contextdeque.patch.factors``): by default every one of ``("hi",
            "bf16", "int8", "int4")`` — each direction's precision is allocated with its rank
            under the same byte cap (quantized factors, dequantized before the kernels; measured
            4.8-7.5x fewer bytes than fp32 uniform ranks for the same η); ``("hi",)`` keeps every
            direction at the page's storage dtype (the rank-only allocation). See
            docs/fidelity.md.
        kv_selection: a ``SelectionPolicy``: under memory pressure (more rows per KV head than
            its threshold) ``generate`` decodes over the rows its selector keeps (MM-ShiftKV,
            SnapKV, StreamingLLM); None: always the full window.
        beyond_trained: allow positions past the model's trained context length
            (``max_position_embeddings``); by default an operation that would place tokens there
            raises ``PositionError`` and leaves the window as it was.
        chunk_template: how ``text=`` appends are rendered before tokenizing: ``{text}`` is the
            text, ``{label}`` the append's label (empty when none). The default ``"{text}"`` adds
            nothing: chunks are concatenated exactly as given, with no separator between them
            (the model sees ``root + chunk1 + chunk2 ...``). ``"{text}\n\n"`` ends every text
            chunk with a blank line; ``"<doc title='{label}'>\n{text}\n</doc>\n"`` wraps it.
            Token ids, embeddings and encoded chunks are taken as given. The template is part
            of the content: the same text under another template is another chunk.
        max_evicted: how many evicted refs the window remembers (each keeps its source, the
            chunk's input ids, so it can be recalled or re-encoded: ~16 bytes per token plus a
            few hundred bytes). Past it the oldest evicted refs are forgotten, as ``purge`` would
            (the receipt's notes say so; their store entries stay). None: remember every one
            (memory then grows with the history).
        anticipate: in :meth:`heal` and the idle healer, once the queued work is done, also
            prepare what the next likely re-reads need (``window.anticipation``: the canonical of
            the chunk the next slide brings to the front; the recall patches of the chunks
            :meth:`expect` names and of the most recently evicted ones, for the arrangement their
            recall would produce; the patches of the orders :meth:`expect_order` names and of the
            likeliest reorders), so those steps run no forward. Idle forwards only, never on the
            critical path (on by default); False: heal does only the queued work, as the
            latency-first policy did before anticipation.
        recall_placement: where ``recall(ref)`` without ``at`` goes: ``"valid"`` (the default: the
            placement scheduler's choice of where a stored patch stays valid — behind the chunks its
            patch was formed on, or the front where its canonical is exact — else the end), another
            placement policy, or None (the window's ``placement`` at the end: the behaviour before
            issue 21). ``recall(ref, at=i)`` / ``at="end"`` always insist.
        answer_kl_budget: a fidelity floor in nats (``window.budget``): after an operation whose
            deferred chunks (served stale or blind: anticipation missed) bring the estimated
            next-token KL of the arrangement above it, the chunk that matters most is healed at once
            (one heal step on the critical path), if predicted to fit ``kl_budget_ms``; the
            receipt's ``budget`` says per chunk what was served and the estimated KL. None: no floor.
        kl_budget_ms: the time cap of that heal step (None: no cap).
        blind_kl: the next-token KL one blind chunk costs the answer, the estimate's scale (default:
            measured on the default model).
        recall_predictor: what anticipation expects to be recalled next, ranked by expected
            benefit per idle token (``window.predictor``): ``"session"`` (hints, recency and
            statistics learned from this window's own steps), ``"recency"``, another registered
            name or a ``RecallPredictor``.
        factorization_cost: what a heal's token budget (``heal(max_tokens=...)``) charges per token
            a patch factorizes (its SVD, beyond the conditioned forward: also a patch taken from a
            forward already run), in prefill tokens: the cost model's ``svd_s_per_token`` x its
            prefill tokens/s (``replay --idle-rate`` sets it from the calibration). 0: the budget
            counts forwards only.
        factorization_fixed: what that budget charges per patch factorized (one top-m factorization
            over all layers, whose cost does not grow with the chunk), in prefill tokens: the cost
            model's ``form_fixed_s`` x its prefill tokens/s. 0: no per-patch charge.
        forward_fixed: what that budget charges per forward beside its tokens (a forward's fixed
            part, which no rate scales away), in prefill tokens: the cost model's
            ``forward_fixed_s`` x its prefill tokens/s (``replay --idle-rate`` sets it from the
            calibration). 0: a forward costs its tokens only.
    """

    def __init__(
        self,
        backend: Any,
        root: str | Sequence[int] | None = None,
        budget_tokens: int | None = None,
        rank: int = DEFAULT_RANK,
        store: Any = None,
        patch_policy: "str | PatchPolicy" = "default",
        cascade_policy: str = "reform",
        *,
        overflow: str = "slide",
        storage: torch.dtype | str = torch.float32,
        placement: "str | PlacementPolicy" = "arrival",
        fidelity_target: float | None = None,
        max_patch_fraction: float = 0.25,
        on_miss: str = DEFAULT_ON_MISS,
        patch_precisions: "tuple[str, ...]" = DEFAULT_PATCH_PRECISIONS,
        kv_selection: "SelectionPolicy | None" = None,
        beyond_trained: bool = False,
        chunk_template: str = "{text}",
        max_evicted: int | None = DEFAULT_MAX_EVICTED,
        anticipate: bool = True,
        recall_placement: "str | PlacementPolicy | None" = DEFAULT_RECALL_PLACEMENT,
        answer_kl_budget: float | None = None,
        kl_budget_ms: float | None = DEFAULT_KL_BUDGET_MS,
        blind_kl: float = DEFAULT_BLIND_KL,
        recall_predictor: "str | RecallPredictor" = "session",
        factorization_cost: float = 0.0,
        factorization_fixed: float = 0.0,
        forward_fixed: float = 0.0,
    ) -> None:
        root = self._checked_root(backend, root)
        config = WindowConfig(
            budget_tokens=budget_tokens, rank=rank, patch_policy=patch_policy, cascade_policy=cascade_policy,
            overflow=overflow, storage=storage, placement=placement, fidelity_target=fidelity_target,
            max_patch_fraction=max_patch_fraction, on_miss=on_miss, patch_precisions=patch_precisions,
            kv_selection=kv_selection,
            beyond_trained=beyond_trained, chunk_template=chunk_template, max_evicted=max_evicted,
            anticipate=anticipate, recall_placement=recall_placement, answer_kl_budget=answer_kl_budget,
            kl_budget_ms=kl_budget_ms, blind_kl=blind_kl, recall_predictor=recall_predictor,
            factorization_cost=factorization_cost, factorization_fixed=factorization_fixed, forward_fixed=forward_fixed,
        )
        self._start(backend_with_root(backend, root), store, config)

    @classmethod
    def from_config(cls, backend: Any, config: WindowConfig, *, root: str | Sequence[int] | None = None,
                    store: Any = None) -> "ContextWindow":
        """A window over ``backend`` with the settings of ``config`` (a :class:`WindowConfig`, checked
        when it was made); ``root`` and ``store`` as for the constructor."""
        if not isinstance(config, WindowConfig):
            raise WindowTypeError(f"config must be a WindowConfig, got {type(config).__name__}")
        win = cls.__new__(cls)
        win._start(backend_with_root(backend, cls._checked_root(backend, root)), store, config)
        return win

    @staticmethod
    def _checked_root(backend: Any, root: str | Sequence[int] | None) -> str | list[int] | None:
        """``backend`` is a backend and ``root`` text or token ids of its vocabulary (or None)."""
        if not all(hasattr(backend, a) for a in ("encode", "forward", "layout", "fingerprint", "root_ids")):
            raise WindowTypeError(
                f"backend must be an HFBackend (e.g. contextdeque.load_model()), got {type(backend).__name__}"
            )
        if root is None or isinstance(root, str):
            return check_str("root", root) if root is not None else None
        return check_token_ids("root", root, backend.vocab_size, error=WindowError).tolist()

    def _start(self, backend: Any, store: Any, config: WindowConfig) -> None:
        """The window family's context from ``config``, and an empty state."""
        ctx = WindowContext(
            backend=backend,
            store=WindowStore.wrap(store, backend.device),
            policy=make_policy(config.patch_policy),
            config=config,
            placement=make_placement(config.placement),
            recall_placement=config.recall_placement,  # made on first use (placement.recall_chooser)
        )
        self._setup(ctx, WindowState(), parent=None)
        self._reserve_working_set(ctx)

    @staticmethod
    def _reserve_working_set(ctx: WindowContext) -> None:
        """A window within a token budget keeps at most ``budget_tokens`` tokens of placed pages
        outside the store, and under a latency-first policy as many of provisional KV (content
        whose canonical waits: the window holds it, the store does not): count them against the
        store's memory budget while the window family (this window and its forks, one context)
        lives."""
        if ctx.budget_tokens is None:
            return
        channels = ctx.backend.layout.kv_channels
        per_token = channels * ctx.backend.dtype.itemsize
        if ctx.policy.defers_canonical:
            per_token += channels * ctx.storage.itemsize
        owner = f"window-{id(ctx):x}"
        if ctx.store.reserve_working_set(owner, ctx.budget_tokens * per_token, ctx.backend.device) is not None:
            weakref.finalize(ctx, ctx.store.reserve_working_set, owner, 0, ctx.backend.device)

    @classmethod
    def _over(cls, ctx: WindowContext, state: WindowState, parent: "ContextWindow | None" = None) -> "ContextWindow":
        """A window over an existing (already checked) context and state: the constructor path of
        :meth:`fork`, which shares its parent's context and starts from a copy of its state."""
        win = cls.__new__(cls)
        win._setup(ctx, state, parent)
        return win

    def _setup(self, ctx: WindowContext, state: WindowState, parent: "ContextWindow | None") -> None:
        """Every field of a window, in one place: ``__init__`` and :meth:`_over` both come here."""
        self._ctx = ctx
        self._state = state
        self._parent = parent
        self._base_generation: int | None = None if parent is None else parent._state.generation
        self._closed = False
        self.last_receipt: Receipt | None = None
        self.receipts: deque[Receipt] = deque(maxlen=1000)
        #: the manifest this window was reopened from (``ContextWindow.open``), else None
        self.session: Any = None

    # ================================================================== machinery
    def _check_open(self) -> None:
        if self._closed:
            raise WindowError("this window was committed, discarded or closed")

    def _run(
        self, op: str, body: Callable[[WindowState, Meter], tuple[dict[str, Any], T]], *, mutates: bool = True
    ) -> tuple[Receipt, T]:
        """Run ``body`` on a copy of the state; swap it in only if it succeeds. ``body`` returns
        the receipt's fields and the operation's result; ``_run`` returns the receipt and that result."""
        with self._ctx.foreground():
            self._check_open()
            meter = Meter(self._ctx, op)
            new = self._state.copy() if mutates else self._state
            fields, result = body(new, meter)
            if mutates and _same_state(self._state, new):
                meter.notes.append("no change")  # a no-op is not a change: forks may still commit
            elif mutates:
                decode.check_trained(self._ctx, decode.next_position(self._ctx, new.slots), op)
                self._install(new, meter)
            receipt = meter.finish(**fields)
            self._record(receipt)
        release_freed_heap()  # pages and activations this operation freed go back to the OS (core.heap)
        if op in BUDGETED_OPS and self._ctx.config.answer_kl_budget is not None:
            budget.learn_rate(self, receipt)
            receipt = budget.enforce(self, receipt)  # (window.budget: the fidelity floor)
        return receipt, result

    def _install(self, new: WindowState, meter: Meter) -> None:
        new.settle_pending({r: d[0] for r, d in meter.deferred.items()}, meter.reconditioned, meter.carried)
        before, after = self._state.held_keys(), new.held_keys()
        # Neither raises for a store fault (promotion and demotion are best effort, nothing is
        # lost): past this point the operation has succeeded and the swap cannot half-happen.
        meter.notes.extend(self._ctx.store.hold(list((after - before).elements()), meter.traffic))
        meter.notes.extend(self._ctx.store.release(list((before - after).elements()), meter.traffic))
        self._forget_oldest_evicted(new, meter)
        new.graph.sync(new.slots, new.evicted)
        new.generation = self._state.generation + 1
        self._state = new

    def _forget_oldest_evicted(self, state: WindowState, meter: Meter) -> None:
        """Keep at most ``max_evicted`` evicted refs (``evicted`` is in eviction order)."""
        cap = self._ctx.max_evicted
        over = 0 if cap is None else len(state.evicted) - cap
        if over <= 0:
            return
        for ref in list(state.evicted)[:over]:
            del state.evicted[ref]
            state.graph.remove(ref)
        meter.notes.append(f"forgot the {over} oldest evicted ref(s) (max_evicted={cap}): they can no longer be recalled")

    def _record(self, receipt: Receipt) -> None:
        self.last_receipt = receipt
        self.receipts.append(receipt)
        self._observe(receipt)  # the recall predictor learns from the session's own steps

    @staticmethod
    def _evict_at(state: WindowState, slots: list[Slot], idx: int, reasons: dict[ChunkRef, str]) -> ChunkRef:
        """Remove ``slots[idx]`` into ``state.evicted``; the slots after it become survivors."""
        s = slots.pop(idx)
        state.evicted[s.ref] = EvictedEntry(
            ref=s.ref,
            chunk_key=WindowStore.chunk_key(s.chunk),
            chunk_id=s.chunk.id,
            n_tokens=s.n_tokens,
            span=s.span,
            stale_patch_keys=tuple(c.key for c in s.stack if c.key),
            formed_on=s.conditioned_on,
            source=ingest.source_of(s.chunk),
            unhealed=bool(s.provisional),
        )
        reasons.pop(s.ref, None)
        for later in slots[idx:]:
            reasons.setdefault(later.ref, "survivor")
        return s.ref

    def _make_room(self, state: WindowState, slots: list[Slot], need: int, reasons: dict[ChunkRef, str]) -> list[ChunkRef]:
        """Slide the oldest chunks out until ``need`` more tokens fit the budget."""
        budget = self._ctx.budget_tokens
        left: list[ChunkRef] = []
        if budget is None:
            return left
        while sum(s.n_tokens for s in slots) + need > budget:
            if self._ctx.overflow == "error":
                raise BudgetError(
                    f"{need} more tokens exceed the budget ({sum(s.n_tokens for s in slots)} of {budget} used); "
                    "slide or evict first, or use overflow='slide'"
                )
            left.append(self._evict_at(state, slots, 0, reasons))
        return left

    # ================================================================== operations
    def append(
        self,
        text: str | None = None,
        *,
        token_ids: Sequence[int] | torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
        chunk: Chunk | None = None,
        rel_positions: torch.Tensor | None = None,
        span: int | None = None,
        modality: str | None = None,
        image: Any = None,
        processor: Any = None,
        label: str | None = None,
    ) -> ChunkRef:
        """Append a chunk at the end of the window; returns its ref (``ref.receipt`` is the receipt).

        Give exactly one of ``text``, ``token_ids [T]``, ``embeds [T, hidden]`` (with the span's
        ``rel_positions [n_axes, T]`` / ``span`` for an image), ``image`` (with the VL model's
        ``processor``: the vision tower runs only for pixels the store has not seen) or an encoded
        ``chunk``. ``label`` names the ref (``ref.label``; shown by :meth:`show`). Content
        the store already holds is never encoded again. If the budget is full, the oldest
        chunks slide out first (see ``overflow``).

        Raises:
            BudgetError: the chunk alone is larger than the budget (or, with ``overflow="error"``,
                does not fit now: refused before anything is encoded).
            FingerprintMismatchError: ``chunk`` comes from another model, layout or root.
            ArgumentTypeError / WindowError: a content argument of the wrong type or value (ids
                outside the vocabulary, embeddings of another width, ...), named in the message.
        """
        def body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], ChunkRef]:
            defer = self._ctx.policy.defers_canonical
            inputs = ingest.check_inputs(
                self._ctx, text=text, token_ids=token_ids, embeds=embeds, chunk=chunk,
                rel_positions=rel_positions, span=span, modality=modality, label=label,
            )
            c = ingest.chunk_from_inputs(
                self._ctx, meter, **inputs, image=image, processor=processor,
                defer_encode=defer, used_tokens=state.tokens_used,
            )
            ingest.check_fits(self._ctx, c.n_tokens)
            slots = list(state.slots)
            reasons: dict[ChunkRef, str] = {}
            left = self._make_room(state, slots, c.n_tokens, reasons)
            if isinstance(c, ingest.Unencoded):
                if slots:  # one conditioned forward after the (re-placed) window, like a prefix cache
                    slots, _ = reconcile(self._ctx, slots, reasons, meter)
                    slots, reasons = list(slots), {}
                    new = ingest.provisional(self._ctx, c, slots, meter, label)
                else:  # nothing in front: the canonical is what the model would cache
                    c = ingest.encode_and_store(self._ctx, meter, **c.inputs)
                    new = Slot(ref=new_ref(c.id, c.n_tokens, label), chunk=c)
            else:
                new = Slot(ref=new_ref(c.id, c.n_tokens, label), chunk=c)
            ref = new.ref
            at = window_index(self._ctx, state.graph, slots, new, len(slots))
            slots.insert(at, new)
            reasons[ref] = "append"
            for later in slots[at + 1 :]:
                reasons.setdefault(later.ref, "inserted")
            state.slots, _ = reconcile(self._ctx, slots, reasons, meter)
            return {"refs": (ref,), "left": tuple(left)}, ref

        receipt, ref = self._run("append", body)
        return ref.with_receipt(receipt)

    def extend(self, items: Sequence[Any], *, overlap: bool = True, workers: int = 1) -> Receipt:
        """Append several chunks, in order, as one operation; ``receipt.refs`` are their refs.

        ``items``: text, encoded ``Chunk`` objects, or dicts of :meth:`append`'s arguments.
        Canonicals in a slower store tier (host, disk, remote) are loaded on ``workers``
        background threads while this thread encodes the ones the store lacks and forms the
        patches (``overlap=False``: one after another, the same result bit for bit). A load
        that fails is recomputed instead (``receipt.load_fallbacks``); ``receipt.loading``
        says how loads and compute overlapped. Same budget and policy behaviour as ``append``.
        """
        from .overlap import extend_body

        receipt, _ = self._run("extend", lambda state, meter: (extend_body(self, state, meter, items, overlap, workers), None))
        return receipt

    def slide(self, n: int = 1) -> Receipt:
        """The ``n`` oldest chunks leave the window (evicted: recallable); survivors re-rotate to
        their new positions (and get what the patch policy says: nothing by default)."""

        def body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], None]:
            check_int("n", n, minimum=0, error=WindowError)
            if n > len(state.slots):
                raise WindowError(f"n: cannot slide {n} chunk(s) out of a window of {len(state.slots)}")
            slots = list(state.slots)
            reasons: dict[ChunkRef, str] = {}
            left = [self._evict_at(state, slots, 0, reasons) for _ in range(n)]
            state.slots, _ = reconcile(self._ctx, slots, reasons, meter)
            return {"refs": tuple(left), "left": tuple(left)}, None

        return self._run("slide", body)[0]

    def evict(self, ref: ChunkRef) -> Receipt:
        """Drop ``ref``'s conditioned KV from the window; its canonical and patches move one tier
        down in the store (unless another window or fork still holds them). Later chunks
        shift back and are survivors (patch policy decides; default: relocate only).

        Raises:
            UnknownRefError: ``ref`` is unknown here (or purged). WindowError: already evicted.
        """

        def body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], None]:
            state.check_known(ref)
            idx = state.index(ref)
            slots = list(state.slots)
            reasons: dict[ChunkRef, str] = {}
            self._evict_at(state, slots, idx, reasons)
            state.slots, _ = reconcile(self._ctx, slots, reasons, meter)
            return {"refs": (ref,), "left": (ref,)}, None

        return self._run("evict", body)[0]

    def recall(self, ref: ChunkRef, at: int | str | None = None) -> Receipt:
        """Re-instate an evicted chunk from its canonical, with a *fresh* patch on the chunks now in
        front of it (per the patch policy). The encoder never re-runs and the patch it carried when
        evicted is never replayed.

        Where it goes: ``at=None`` lets the window choose (``recall_placement``, default
        ``"valid"``: where a stored patch stays valid — behind the chunks its patch was formed on,
        where the chunks conditioned on it become valid again, or the front, where its canonical
        is exact — and otherwise the end); ``at=i`` insists on index ``i`` and ``at="end"``
        (``placement.END``) on the end (both as the window's ``placement`` policy honours asked
        positions: exactly, under ``"arrival"``). The receipt's ``placed`` says where it went and why.

        ``at`` indexes the window before any budget slide; if the oldest chunks must slide out
        to make room, the insertion point moves back with them. The receipt's ``cascade`` says
        which chunks were conditioned on the recalled one and became stale, and what the
        cascade policy did about them.

        Raises:
            UnknownRefError: ``ref`` unknown, purged, or its canonical is gone from the store.
            WindowError: ``ref`` is in the window, or ``at`` is out of range.
        """

        def body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], None]:
            ctx = self._ctx
            state.check_known(ref)
            if ref not in state.evicted:
                raise WindowError(f"{ref!r} is already in the window (use reorder to move it)")
            entry = state.evicted[ref]
            pinned = at is not None
            if at is None or at == END:
                pos = len(state.slots)
            elif isinstance(at, str):
                raise WindowTypeError(f"at: a recall position is an index or {END!r}, got {at!r}")
            else:
                pos = check_int("at", at, error=WindowError)
            if not 0 <= pos <= len(state.slots):
                raise WindowError(f"at: recall position {at} is outside 0..{len(state.slots)}")
            ingest.check_fits(self._ctx, entry.n_tokens)
            if entry.provisional is not None:  # left before it was healed: its canonical, now
                chunk = ingest.canonical_of(self._ctx, entry.provisional, meter)
            else:
                chunk = ingest.load_canonical(ctx, entry.chunk_key, meter)
            # left before anything needed its canonical: under a latency-first policy, one
            # conditioned forward where it re-enters (what a prefix cache re-reading it runs; the
            # canonical still waits), else the one encode it owes
            forward_in = chunk is None and entry.unhealed and ctx.policy.lazy_canonicals
            if chunk is None and entry.unhealed and not forward_in:
                chunk = ingest.encode_and_store(ctx, meter, **entry.source)
            elif chunk is None and entry.source is not None and not forward_in:  # lost or quarantined: rebuild it
                chunk = ingest.rebuilt(ctx, meter, entry.source, "its canonical was gone from the store")
            elif chunk is None and not forward_in:
                budgeted = any(b is not None for b in ctx.store.store.budget_bytes().values())
                why = "deleted, quarantined as corrupt, or dropped by a tier's budget" if budgeted else "deleted or quarantined as corrupt"
                raise UnknownRefError(
                    f"{ref!r}: its canonical is no longer in the store ({why}) and this window kept no "
                    "source to rebuild it; append its content again"
                )
            candidates = frozenset(state.graph.preview_cascade(ref, state.refs))
            slots = list(state.slots)
            reasons: dict[ChunkRef, str] = {}
            left = self._make_room(state, slots, entry.n_tokens, reasons)
            pos = max(0, pos - len(left))
            del state.evicted[ref]
            if forward_in and pos == 0:  # nothing in front: its canonical is what the model would cache
                chunk, forward_in = ingest.encode_and_store(ctx, meter, **entry.source), False
            if forward_in:
                # the chunks in front as they will stand, then the forward behind them (as append)
                slots, _ = reconcile(ctx, slots, reasons, meter)
                slots, reasons = list(slots), {}
                pending = ingest.Unencoded(entry.chunk_id, entry.n_tokens, entry.source)
                entering = ingest.provisional(ctx, pending, slots[:pos], meter, ref=ref)
                why = "asked" if pinned else "end: no canonical yet (one forward behind the window)"
            else:
                entering = Slot(ref=ref, chunk=chunk)
                asked, chooser = pos, (None if pinned else recall_chooser(ctx))
                if pinned or chooser is None:  # the window's placement, at the asked index (today's rule)
                    pos = window_index(ctx, state.graph, slots, entering, pos, entry.formed_on)
                else:
                    pos = window_index(ctx, state.graph, slots, entering, None, entry.formed_on, policy=chooser)
                why = "asked" if pinned and pos == asked else placement_reason(ctx, slots, entering, pos, False)
            slots.insert(pos, entering)
            reasons[ref] = "append" if forward_in else "recall"  # (provisional: exact where it stands)
            for later in slots[pos + 1 :]:
                reasons[later.ref] = "inserted"
            state.slots, cascade = reconcile(  # (a provisional dependent takes what anticipation prepared)
                ctx, slots, reasons, meter, recalled=ref, cascade_candidates=candidates - set(left), prepared="take"
            )
            return {"refs": (ref,), "left": tuple(left), "cascade": cascade, "placed": ((ref, pos, why),)}, None

        return self._run("recall", body)[0]

    def reorder(self, order: Sequence[ChunkRef]) -> Receipt:
        """Permute the window to ``order`` (every in-window ref exactly once). Slots whose
        antecedents changed get what the patch policy says (default: the orbit patch for their
        new antecedent set where one exists or is worth forming, else a fresh rank-m patch).

        Raises:
            WindowError: ``order`` is not a permutation of the window's refs.
        """

        def body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], None]:
            refs = check_refs("order", order)
            current = state.refs
            if len(refs) != len(current) or set(refs) != set(current) or len(set(refs)) != len(refs):
                missing = [r for r in current if r not in refs]
                extra = [r for r in refs if r not in current]
                raise WindowError(
                    f"reorder needs each of the window's {len(current)} refs exactly once; "
                    f"missing {missing}, not in the window {extra}, given {len(refs)}"
                )
            by_ref = {s.ref: s for s in state.slots}
            slots = [by_ref[r] for r in refs]
            reasons = {r: "reorder" for r in refs}
            state.slots, _ = reconcile(self._ctx, slots, reasons, meter, prepared="take")  # (provisional: what anticipation prepared)
            note_reorder(self._ctx.reorders_seen, current, refs)  # (reorder anticipation learns from these)
            return {"refs": tuple(refs)}, None

        return self._run("reorder", body)[0]

    def purge(self, ref: ChunkRef) -> Receipt:
        """Forget an evicted chunk: it can no longer be recalled (its store entries stay:
        they are content-addressed and may serve other windows)."""

        def body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], None]:
            state.check_known(ref)
            if ref not in state.evicted:
                raise WindowError(f"{ref!r} is in the window: evict it before purging")
            del state.evicted[ref]
            state.graph.remove(ref)
            return {"refs": (ref,)}, None

        return self._run("purge", body)[0]

    def refresh(self, refs: Sequence[ChunkRef] | None = None) -> Receipt:
        """Re-condition ``refs`` (default: the chunks flagged stale) on what now precedes them."""

        def body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], None]:
            targets = check_refs("refs", refs) if refs is not None else [s.ref for s in state.slots if s.stale]
            for r in targets:
                state.check_known(r)
                state.index(r)
            reasons = {r: "refresh" for r in targets}
            state.slots, _ = reconcile(self._ctx, list(state.slots), reasons, meter)
            return {"refs": tuple(targets)}, None

        return self._run("refresh", body)[0]


__all__ = ["ContextWindow", "Answer", "Verdict", "Cascade", "Receipt", "ChunkRef", "PAGES"]
