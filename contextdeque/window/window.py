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

import dataclasses
import functools
import os
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import torch

from ..core.chunk import Chunk, storage_dtype
from ..core.args import check_float, check_instance, check_int, check_str, check_token_ids
from ..core.errors import BudgetError, UnknownRefError, WindowError, WindowTypeError
from ..core.heap import release_freed_heap
from ..core.kv import LayerKV, kv_nbytes
from ..patch import Patch, form_patch
from . import decode, ingest
from .context import DEFAULT_MAX_EVICTED, WindowContext
from .disposable import Verdict, run_test
from .graph import Cascade, ConditioningGraph
from .kvselect import SelectionPolicy
from .placement import PlacementPolicy, make_placement, window_index
from .policy import PatchPolicy, make_policy
from .policy_latency import HealPolicy
from .receipt import PAGES, Meter, Receipt
from .reconcile import patch_store_key, reconcile
from .ref import ChunkRef, new_ref
from .root import backend_with_root
from .slot import Slot
from .staleness import staleness
from .state import EvictedEntry, WindowState
from .store import WindowStore

if TYPE_CHECKING:  # pragma: no cover
    from .healer import Healer

T = TypeVar("T")


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


def _foreground(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a window method as a foreground operation (the idle healer gives way to it)."""

    @functools.wraps(method)
    def wrapper(self: "ContextWindow", *args: Any, **kwargs: Any) -> Any:
        with self._ctx.foreground():
            return method(self, *args, **kwargs)

    return wrapper


@dataclass
class Answer:
    """What ``ContextWindow.generate`` returns: the answer's ids, its text (with a tokenizer),
    and the receipt. ``str(answer)`` is the text."""

    token_ids: list[int]
    text: str | None
    receipt: Receipt | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return self.text if self.text is not None else " ".join(map(str, self.token_ids))


class ContextWindow:
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
        fidelity_target: the safety envelope: when set (e.g. 0.99), each patch's rank is chosen
            per chunk from Δ's singular spectrum — the smallest m capturing this fraction of Δ's
            energy (K and V separately) — instead of the global ``rank``, capped so a patch
            never exceeds ``max_patch_fraction`` of its page's bytes.
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
    """

    def __init__(
        self,
        backend: Any,
        root: str | Sequence[int] | None = None,
        budget_tokens: int | None = None,
        rank: int = 32,
        store: Any = None,
        patch_policy: "str | PatchPolicy" = "default",
        cascade_policy: str = "reform",
        *,
        overflow: str = "slide",
        storage: torch.dtype | str = torch.float32,
        placement: "str | PlacementPolicy" = "arrival",
        fidelity_target: float | None = None,
        max_patch_fraction: float = 0.25,
        kv_selection: "SelectionPolicy | None" = None,
        beyond_trained: bool = False,
        chunk_template: str = "{text}",
        max_evicted: int | None = DEFAULT_MAX_EVICTED,
    ) -> None:
        if not all(hasattr(backend, a) for a in ("encode", "forward", "layout", "fingerprint", "root_ids")):
            raise WindowTypeError(
                f"backend must be an HFBackend (e.g. contextdeque.load_model()), got {type(backend).__name__}"
            )
        if root is not None:
            if isinstance(root, str):
                check_str("root", root)
            else:
                root = check_token_ids("root", root, backend.vocab_size, error=WindowError).tolist()
        backend = backend_with_root(backend, root)
        if kv_selection is not None and not isinstance(kv_selection, SelectionPolicy):
            raise WindowTypeError(f"kv_selection must be a SelectionPolicy, got {type(kv_selection).__name__}")
        if not (isinstance(patch_policy, (str, PatchPolicy))):
            raise WindowTypeError(f"patch_policy must be a policy name or a PatchPolicy, got {type(patch_policy).__name__}")
        if not (isinstance(placement, (str, PlacementPolicy))):
            raise WindowTypeError(f"placement must be a policy name or a PlacementPolicy, got {type(placement).__name__}")
        check_str("cascade_policy", cascade_policy, error=WindowError)
        check_str("overflow", overflow, error=WindowError)
        if not isinstance(storage, (str, torch.dtype)):
            raise WindowTypeError(f"storage must be a dtype or its name, got {type(storage).__name__}")
        if not isinstance(beyond_trained, bool):
            raise WindowTypeError(f"beyond_trained must be a bool, got {type(beyond_trained).__name__}")
        ingest.check_template(chunk_template)
        ctx = WindowContext(
            backend=backend,
            store=WindowStore.wrap(store, backend.device),
            policy=make_policy(patch_policy),
            rank=check_int("rank", rank, minimum=0, error=WindowError),
            budget_tokens=check_int("budget_tokens", budget_tokens, minimum=1, none_ok=True, error=BudgetError),
            cascade_policy=cascade_policy,
            overflow=overflow,
            storage=storage_dtype(storage),
            placement=make_placement(placement),
            fidelity_target=check_float("fidelity_target", fidelity_target, minimum=0.0, maximum=1.0, open_min=True,
                                        none_ok=True, error=WindowError),
            max_patch_fraction=check_float("max_patch_fraction", max_patch_fraction, minimum=0.0, maximum=1.0,
                                           open_min=True, error=WindowError),
            kv_selection=kv_selection,
            beyond_trained=beyond_trained,
            chunk_template=chunk_template,
            max_evicted=check_int("max_evicted", max_evicted, minimum=0, none_ok=True, error=WindowError),
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

    # ================================================================== introspection
    @property
    def backend(self) -> Any:
        """The backend (a view carrying the window's root if one was given)."""
        return self._ctx.backend

    @property
    def context(self) -> WindowContext:
        """The explicit shared context (backend, store, policy, counters)."""
        return self._ctx

    @property
    def policy(self) -> PatchPolicy:
        return self._ctx.policy

    @property
    def store(self) -> WindowStore:
        return self._ctx.store

    @property
    def graph(self) -> ConditioningGraph:
        """The conditioning graph (read it; the window keeps it in sync)."""
        return self._state.graph

    @property
    def refs(self) -> tuple[ChunkRef, ...]:
        """The chunks in the window, in order."""
        return self._state.refs

    @property
    def evicted_refs(self) -> tuple[ChunkRef, ...]:
        """Evicted chunks that can be recalled."""
        return tuple(self._state.evicted)

    @property
    def tokens_used(self) -> int:
        """Chunk tokens in the window (root excluded)."""
        return self._state.tokens_used

    @property
    def budget_tokens(self) -> int | None:
        return self._ctx.budget_tokens

    @property
    def root_ids(self) -> tuple[int, ...]:
        return tuple(self._ctx.backend.root_ids)

    @property
    def stale_refs(self) -> tuple[ChunkRef, ...]:
        """Chunks flagged stale by a recall cascade (``cascade_policy="flag"``)."""
        return tuple(s.ref for s in self._state.slots if s.stale)

    @property
    def parent(self) -> "ContextWindow | None":
        return self._parent

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def generation(self) -> int:
        """Counts successful state-changing operations."""
        return self._state.generation

    def __len__(self) -> int:
        return len(self._state.slots)

    def __contains__(self, ref: object) -> bool:
        return any(s.ref == ref for s in self._state.slots)

    def placement(self) -> list[tuple[ChunkRef, int, int]]:
        """``(ref, start, end)`` per chunk: contiguous from ``root_len`` on."""
        return [(s.ref, s.start, s.end) for s in self._state.slots]

    def next_position(self) -> int:
        """Position of the first token after the window."""
        return decode.next_position(self._ctx, self._state.slots)

    def slot(self, ref: ChunkRef) -> Slot:
        """The slot of an in-window chunk (read-only record)."""
        return self._state.slots[self._state.index(ref)]

    def kv(self, ref: ChunkRef) -> list[LayerKV]:
        """The KV the model sees for ``ref``: per layer ``(k [H_k, T, d_k], v [H_v, T, d_v])``."""
        page = self.slot(ref).page
        assert page is not None
        return list(page)

    def patches(self, ref: ChunkRef) -> tuple[Patch, ...]:
        """The conditioning patches ``ref`` carries (empty: blind canonical)."""
        return self.slot(ref).patches

    def chunk(self, ref: ChunkRef) -> Chunk:
        return self.slot(ref).chunk

    def cascade_preview(self, ref: ChunkRef) -> tuple[ChunkRef, ...]:
        """In-window chunks transitively conditioned on ``ref`` (at most what recalling it
        would make stale)."""
        return self._state.graph.preview_cascade(ref, self.refs)

    def text(self, *, root: bool = False) -> str:
        """What the window holds, as text: each chunk's tokens decoded, concatenated exactly as
        the model sees them (no separator is added: see ``chunk_template``); an image chunk
        appears as ``[image: N tokens]``. ``root=True`` starts with the root.

        Raises:
            WindowError: the backend has no tokenizer.
        """
        tok = self._ctx.backend.tokenizer
        if tok is None:
            raise WindowError("text() needs a tokenizer; this backend has none (read window.chunk(ref).token_ids)")
        parts = [tok.decode(list(self.root_ids))] if root else []
        for s in self._state.slots:
            ids = s.chunk.token_ids
            parts.append(tok.decode(ids.tolist()) if ids is not None else f"[{s.chunk.modality}: {s.n_tokens} tokens]")
        return "".join(parts)

    def table(self) -> Any:
        """The window as a ``rich`` table (see :meth:`show`)."""
        from .view import window_table

        return window_table(self)

    def show(self, console: Any = None) -> None:
        """Print the window as a table: per chunk its position span, tokens, label, conditioning
        (patch kind@rank, or blind), staleness and the store tier of its canonical; evicted chunks
        after it. ``console``: a ``rich.console.Console`` (default: stdout). Returns None (a REPL
        echoes nothing after the table); :meth:`table` returns the table itself."""
        from rich.console import Console

        (console or Console()).print(self.table())

    def __repr__(self) -> str:
        b = "" if self._ctx.budget_tokens is None else f"/{self._ctx.budget_tokens}"
        kind = "fork" if self._parent is not None else "window"
        return (
            f"ContextWindow({kind}, {len(self)} chunks, {self.tokens_used}{b} tokens, "
            f"{len(self._state.evicted)} evicted, policy={self._ctx.policy.name})"
        )

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

    def recall(self, ref: ChunkRef, at: int | None = None) -> Receipt:
        """Re-instate an evicted chunk at index ``at`` (default: the end) from its canonical, with
        a *fresh* patch on the chunks now in front of it (per the patch policy). The encoder
        never re-runs and the patch it carried when evicted is never replayed.

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
            pos = len(state.slots) if at is None else check_int("at", at, error=WindowError)
            if not 0 <= pos <= len(state.slots):
                raise WindowError(f"at: recall position {at} is outside 0..{len(state.slots)}")
            ingest.check_fits(self._ctx, entry.n_tokens)
            if entry.provisional is not None:  # left before it was healed: its canonical, now
                chunk = ingest.canonical_of(self._ctx, entry.provisional, meter)
            else:
                chunk = ctx.store.get_chunk(
                    entry.chunk_key, fingerprint=ctx.fingerprint, layout=ctx.layout.signature, traffic=meter.traffic
                )
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
            else:
                entering = Slot(ref=ref, chunk=chunk)
                pos = window_index(ctx, state.graph, slots, entering, pos, entry.formed_on)
            slots.insert(pos, entering)
            reasons[ref] = "append" if forward_in else "recall"  # (provisional: exact where it stands)
            for later in slots[pos + 1 :]:
                reasons[later.ref] = "inserted"
            state.slots, cascade = reconcile(
                ctx, slots, reasons, meter, recalled=ref, cascade_candidates=candidates - set(left)
            )
            return {"refs": (ref,), "left": tuple(left), "cascade": cascade}, None

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
            state.slots, _ = reconcile(self._ctx, slots, reasons, meter)
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

    def heal(self, max_ms: float | None = None, *, max_steps: int | None = None) -> Receipt:
        """Carry out the conditioning a latency-first policy deferred, most urgent first.

        Each step takes the pending chunk of highest :meth:`heal_priority` and heals it together
        with the pending chunks in front of it (a patch is formed on its antecedents' current
        KV, so they go first), running the eager policy's decisions on the window as it stands;
        each step is one transaction (an error or interruption leaves the window as it was
        before that step). Stops when nothing is pending, after ``max_steps`` steps, or once
        ``max_ms`` have passed (checked between steps). Returns one receipt for all steps
        (``op="heal"``; each step is also in ``receipts``). Under an eager policy nothing is
        ever pending and this is a no-op.
        """
        self._check_open()
        check_float("max_ms", max_ms, minimum=0.0, none_ok=True, error=WindowError)
        check_int("max_steps", max_steps, minimum=0, none_ok=True, error=WindowError)
        t0 = time.perf_counter()
        steps: list[Receipt] = []
        while self._state.pending or self._unhealed_evicted():
            if max_steps is not None and len(steps) >= int(max_steps):
                break
            if max_ms is not None and (time.perf_counter() - t0) * 1000.0 >= float(max_ms):
                break
            steps.append(self._heal_step())
        return Receipt.merged("heal", steps, wall_ms=(time.perf_counter() - t0) * 1000.0)

    def _unhealed_evicted(self) -> list[ChunkRef]:
        """Evicted chunks that left before their canonical was computed, which healing encodes
        (``latency-shared``; under ``latency`` their canonical waits for a recall that needs it)."""
        if self._ctx.policy.lazy_canonicals:
            return []
        return [r for r, e in self._state.evicted.items() if e.owes_encode]

    def _heal_step(self) -> Receipt:
        """One heal transaction (see :meth:`heal`)."""

        def body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], None]:
            ctx = self._ctx
            if not state.pending:
                for ref in self._unhealed_evicted()[:1]:  # canonical of a chunk that left unhealed
                    entry = state.evicted[ref]
                    if entry.provisional is not None:
                        ingest.canonical_of(self._ctx, entry.provisional, meter)
                        source = ingest.source_of(entry.provisional)  # so a lost canonical can be rebuilt
                    else:
                        source = entry.source
                        if ctx.store.get_chunk(entry.chunk_key, fingerprint=ctx.fingerprint, layout=ctx.layout.signature,
                                               traffic=meter.traffic) is None:
                            ingest.encode_and_store(ctx, meter, **entry.source)
                    state.evicted[ref] = dataclasses.replace(entry, provisional=None, unhealed=False, source=source)
                    return {"refs": (ref,)}, None
                return {"refs": ()}, None  # healed meanwhile (e.g. by a foreground heal): nothing to do
            target = max(state.pending, key=self.heal_priority)
            idx = state.index(target)
            batch = [s.ref for s in state.slots[: idx + 1] if s.ref in state.pending]
            reasons = {r: state.pending[r].reason for r in batch}
            eager = getattr(ctx.policy, "eager", ctx.policy)
            carried = {r: state.pending[r].carried for r in batch}
            heal_policy = HealPolicy(eager, carried)
            lazy = ctx.policy.lazy_canonicals
            slots = list(state.slots)
            for i, s in enumerate(slots):
                if s.ref not in reasons or not s.provisional:
                    continue
                pending = state.pending[s.ref]
                if i == 0 or not lazy:  # its canonical: exact at the front; latency-shared: always
                    slots[i] = self._canonicalize(s, slots[:i], reasons[s.ref], eager, meter)
                elif pending.reason == "append" and not pending.requeued:
                    del reasons[s.ref]  # exact where it stands: no canonical until something needs one
                else:  # the eager policy would re-condition it: one conditioned forward on its prefix now
                    # heal and place what is in front first: the forward runs after their healed KV
                    head = {r: reasons.pop(r) for r in [x.ref for x in slots[:i]] if r in reasons}
                    slots[:i], _ = reconcile(ctx, slots[:i], head, meter, policy=heal_policy)
                    slots[i] = ingest.reforward(ctx, s, slots[:i], meter)
                    meter.reconditioned.add(s.ref)
                    del reasons[s.ref]
            state.slots, _ = reconcile(ctx, slots, reasons, meter, policy=heal_policy)
            for r in batch:
                state.pending.pop(r, None)
            return {"refs": tuple(batch)}, None

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
        return blind

    def start_healing(self, idle_ms: float = 20.0) -> "Healer":
        """Heal in the background while the window is idle (no foreground operation for
        ``idle_ms``): returns the running :class:`~contextdeque.window.healer.Healer` (call
        ``stop()``, or use it as a context manager). Foreground operations never wait for it
        longer than the layer in flight."""
        from .healer import Healer

        return Healer(self, idle_ms=idle_ms).start()

    # ------------------------------------------------------------------ sessions
    @_foreground
    def save(self, path: "str | os.PathLike[str]") -> Receipt:
        """Save the window to one file at ``path`` (atomic: a crash mid-save leaves what was
        there): order, refs and labels, positions, canonicals and patch stacks, the evicted set
        (with the canonicals the store still holds), pending heals, the conditioning graph,
        policies, budget and a summary of the receipts (``contextdeque.window.session``).
        Reopen it with :meth:`open`."""
        from .session import save_window

        return save_window(self, path)

    @classmethod
    def open(cls, path: "str | os.PathLike[str]", backend: Any, **overrides: Any) -> "ContextWindow":
        """Reopen a window saved with :meth:`save` over ``backend`` (the same model, layout and
        root, else ``SessionError``), running no forward: ``materialize()`` is bit-identical to
        the saved window's, and the session continues (slide, recall, generate...). Refs are
        fresh (same order and labels); ``overrides`` replace saved settings (e.g. ``store=``,
        ``patch_policy=``). ``window.session`` is the manifest it was opened from.

        Raises:
            SessionError: no session there, corrupt, another schema version or another model.
        """
        from .session import open_window

        return open_window(cls, path, backend, **overrides)

    # ------------------------------------------------------------------ forks
    @_foreground
    def fork(self) -> "ContextWindow":
        """A copy-on-write child: shares canonicals, patches and pages (no tensor is copied),
        has its own order, overlay and evicted set. ``child.commit()`` makes the child's state
        the parent's (only if the parent did not change since the fork); ``child.discard()``
        drops it. Nothing the child does changes the parent."""
        self._check_open()
        meter = Meter(self._ctx, "fork")
        child = ContextWindow._over(self._ctx, self._state.copy(), parent=self)
        meter.notes.extend(self._ctx.store.hold(list(child._state.held_keys().elements()), meter.traffic))
        receipt = meter.finish(refs=child.refs)
        self._record(receipt)
        child._record(receipt)
        return child

    @_foreground
    def commit(self) -> Receipt:
        """Make this fork's state its parent's and close the fork.

        Raises:
            WindowError: not a fork, already closed, or the parent changed since the fork.
        """
        self._check_open()
        parent = self._parent
        if parent is None:
            raise WindowError("commit() is for forks; this window has no parent")
        if parent._closed:
            raise WindowError("the parent window is closed")
        if parent._state.generation != self._base_generation:
            raise WindowError(
                "the parent changed since this fork was made (generation "
                f"{self._base_generation} -> {parent._state.generation}); commit refused"
            )
        meter = Meter(self._ctx, "commit")
        # The child's holds become the parent's; the parent's old state lets go of its own.
        meter.notes.extend(self._ctx.store.release(list(parent._state.held_keys().elements()), meter.traffic))
        new = self._state
        new.generation = parent._state.generation + 1
        parent._state = new
        self._closed = True
        receipt = meter.finish(refs=new.refs)
        parent._record(receipt)
        self._record(receipt)
        return receipt

    def discard(self) -> Receipt:
        """Drop this fork (the parent is untouched)."""
        self._check_open()
        if self._parent is None:
            raise WindowError("discard() is for forks; use close() for a window")
        return self.close(op="discard")

    @_foreground
    def close(self, op: str = "close") -> Receipt:
        """Release everything this window holds in the store; further operations raise."""
        self._check_open()
        meter = Meter(self._ctx, op)
        meter.notes.extend(self._ctx.store.release(list(self._state.held_keys().elements()), meter.traffic))
        self._closed = True
        receipt = meter.finish(refs=self.refs)
        self._record(receipt)
        return receipt

    # ------------------------------------------------------------------ reading it out
    def materialize(self) -> Any:
        """The KV the model sees, as a fresh transformers ``DynamicCache`` (batch 1): the root,
        then every chunk's page, ``S = root_len + sum(n_tokens)`` tokens per layer.

        Fresh every call: generating with it (which appends to it) never touches the window.
        Continue it with ``model.generate(input_ids=window.input_ids_for(q),
        past_key_values=cache, ...)``. Under the exact policy it equals the KV of one forward
        over the root and the chunks (to float rounding)."""
        def body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], Any]:
            layers = decode.assemble(self._ctx, state.slots)
            meter.page_bytes += kv_nbytes(layers)
            return {"refs": state.refs}, decode.to_cache(self._ctx, layers)

        return self._run("materialize", body, mutates=False)[1]

    def input_ids_for(self, query: str | Sequence[int] | torch.Tensor, *, chat: bool = True) -> torch.Tensor:
        """``[1, S + Q]`` ids for ``model.generate(input_ids=..., past_key_values=materialize())``:
        the cached prefix's ids (root, then each chunk's tokens) followed by the query's (text is
        tokenized and, with a chat template, closed as a user turn + assistant header).

        Raises:
            WindowError: the window holds a chunk whose span is not its token count (an image):
                ``generate`` would place the query at the wrong position; use
                ``ContextWindow.generate``, which passes positions explicitly.
        """
        self._check_open()
        if not decode.hf_compatible(self._state.slots):
            raise WindowError(
                "the window holds a chunk whose span differs from its token count (or M-RoPE "
                "positions); model.generate cannot continue it: use window.generate"
            )
        ids = decode.prefix_ids(self._ctx, self._state.slots) + decode.query_ids(self._ctx, query, chat=chat)
        return torch.tensor([ids], dtype=torch.long, device=self._ctx.backend.device)

    def generate(self, query: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 32, *, chat: bool = True, **kw: Any) -> Answer:
        """Materialize and decode ``query``. Text-only windows go through
        ``model.generate(input_ids=input_ids_for(query), past_key_values=materialize(), **kw)``
        (greedy unless ``kw`` says otherwise); windows with image spans through the window's own
        greedy decoder with explicit positions."""
        def body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], Answer]:
            check_int("max_new_tokens", max_new_tokens, minimum=1, error=WindowError)
            q = decode.query_ids(self._ctx, query, chat=chat)
            new_ids = decode.answer(self._ctx, state.slots, q, max_new_tokens, meter, **kw)
            return {"refs": state.refs}, Answer(token_ids=new_ids, text=decode.decode_text(self._ctx, new_ids))

        receipt, answer = self._run("generate", body, mutates=False)
        answer.receipt = receipt
        return answer

    def is_disposable(
        self,
        ref: ChunkRef,
        query: str | Sequence[int] | torch.Tensor,
        max_new_tokens: int = 8,
        *,
        drop: bool = False,
        kl_tol: float | None = None,
        chat: bool = True,
    ) -> Verdict:
        """Is ``ref``'s conditioning load-bearing for ``query``?

        Decodes ``query`` (greedy, ``max_new_tokens``) three ways: the window as is; with
        ``ref``'s conditioning toggled off (its page becomes the bare relocated canonical; every
        other chunk as is); and, with ``drop=True``, with ``ref`` dropped (later chunks shift
        back keeping their KV). Disposable when every variant gives the same answer (and,
        with ``kl_tol``, a first-token KL(as is || variant) at most ``kl_tol``). The window
        is not changed.
        """
        def body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], dict[str, Any]]:
            state.check_known(ref)
            idx = state.index(ref)
            check_int("max_new_tokens", max_new_tokens, minimum=1, error=WindowError)
            check_float("kl_tol", kl_tol, minimum=0.0, none_ok=True, error=WindowError)
            q = decode.query_ids(self._ctx, query, chat=chat)
            slot = state.slots[idx]
            # a provisional slot (latency-first, not healed yet) is conditioned by its own forward:
            # its canonical (from the store, else encoded and stored for heal) is the variant without
            canonical = ingest.canonical_of(self._ctx, slot.chunk, meter) if slot.provisional else None
            found = run_test(self._ctx, state.slots, idx, q, max_new_tokens=max_new_tokens, drop=drop, kl_tol=kl_tol,
                             canonical=canonical)
            return {"refs": (ref,)}, found

        receipt, found = self._run("is_disposable", body, mutates=False)
        return Verdict(ref=ref, receipt=receipt, **found)


__all__ = ["ContextWindow", "Answer", "Verdict", "Cascade", "Receipt", "ChunkRef", "PAGES"]
