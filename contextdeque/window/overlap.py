"""``ContextWindow.extend``: append many chunks at once, loading stored ones in parallel with the
model's work (MPIC section 3.2).

The items' canonicals are looked up first (every item gets its canonical: a latency-first
policy's deferral of new content applies to ``append``, not here). Chunks in the store's fastest tier are used as they
are; chunks in a slower tier (host memory, disk, a remote tier) are *loaded*; chunks nowhere in
the store are *misses* and must be encoded. With ``overlap=True`` the loads start at once on
background reader threads (``stores.Prefetcher``: straight tier reads, outside the store's lock)
while the caller's thread encodes the misses and then walks the window in order, appending each
slot and forming its patch (the patch forms are model work too: a later chunk's load continues
while an earlier one is being conditioned). A load that fails — a corrupt or truncated file, an
unreadable directory, a remote tier away — falls back to encoding that chunk, and the receipt's
``load_fallbacks`` says so (the bad copy is replaced by the recomputed one).

``overlap=False`` does the same work one item after another, as a loop of ``append`` would.
Both produce the same window, bit for bit (the same encodes, the same patch forms in the same
order); ``tests/test_overlap.py`` holds them to it, and ``contextdeque load-bench`` measures the
speed-up.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from ..core.chunk import Chunk
from ..core.errors import WindowError
from ..stores import Prefetcher, fetch, settle
from . import ingest
from .placement import window_index
from .receipt import LoadFallback, Meter
from .reconcile import reconcile
from .ref import ChunkRef, new_ref
from .slot import Slot
from .state import WindowState
from .store import WindowStore

if TYPE_CHECKING:  # pragma: no cover
    from .window import ContextWindow

_ITEM_KEYS = {"text", "token_ids", "embeds", "chunk", "rel_positions", "span", "modality", "image", "processor", "label"}


@dataclass
class _Plan:
    """One item: its inputs, content key, and where its canonical comes from (``given``,
    ``resident``: fastest tier, ``load``: a slower tier, ``miss``: nowhere)."""

    spec: dict[str, Any]
    key: str
    kind: str
    tier: str | None
    n_tokens: int
    chunk: Chunk | None = None


def _spec(item: Any) -> dict[str, Any]:
    if isinstance(item, str):
        return {"text": item}
    if isinstance(item, Chunk):
        return {"chunk": item}
    if isinstance(item, Mapping):
        bad = set(item) - _ITEM_KEYS
        if bad:
            raise WindowError(f"extend items take the keys {sorted(_ITEM_KEYS)}; got {sorted(bad)}")
        return dict(item)
    raise WindowError(f"extend items are text, a Chunk, or a dict of append() arguments; got {type(item).__name__}")


def _plan(win: "ContextWindow", meter: Meter, item: Any) -> _Plan:
    ctx = win.context
    spec = _spec(item)
    if spec.get("image") is not None:
        if any(spec.get(k) is not None for k in ("text", "token_ids", "embeds", "chunk")):
            raise WindowError("an extend item needs exactly one of text, token_ids, embeds, image, chunk")
        img = ingest.image_embedding(ctx, spec.pop("image"), spec.pop("processor", None), meter)
        spec.update(embeds=img.embeds, rel_positions=img.rel_positions, span=img.span, modality="image")
    spec.pop("processor", None)
    spec.update(ingest.check_inputs(ctx, **spec))
    if sum(spec.get(k) is not None for k in ("text", "token_ids", "embeds", "chunk")) != 1:
        raise WindowError("an extend item needs exactly one of text, token_ids, embeds, image, chunk")
    if spec.get("chunk") is not None:
        c = spec["chunk"]
        ingest.check_chunk(ctx, c)
        ingest.check_fits(ctx, c.n_tokens)
        return _Plan(spec, WindowStore.chunk_key(c), "given", None, c.n_tokens, c)
    if spec.get("text") is not None:
        spec["token_ids"] = ctx.backend.tokenize(spec.pop("text"))
    ids, emb = spec.get("token_ids"), spec.get("embeds")
    n = int(torch.as_tensor(ids).numel()) if ids is not None else int(emb.shape[0])
    ingest.check_fits(ctx, n)
    cid = ctx.backend.chunk_id_for(token_ids=ids, embeds=emb, rel_positions=spec.get("rel_positions"),
                                   span=spec.get("span"), storage=ctx.storage)
    key = WindowStore.chunk_key(cid, ctx.fingerprint)
    where = ctx.store.store.where(key)
    if not where:
        return _Plan(spec, key, "miss", None, n)
    top = ctx.store.store.tiers[0].name
    return _Plan(spec, key, "resident" if where[0] == top else "load", where[0], n)


def _encode(win: "ContextWindow", plan: _Plan, meter: Meter) -> Chunk:
    """Encode the item's canonical, store it, return the stored copy (``append``'s own path)."""
    s = plan.spec
    return ingest.encode_and_store(win.context, meter, token_ids=s.get("token_ids"), embeds=s.get("embeds"),
                                 rel_positions=s.get("rel_positions"), span=s.get("span"), modality=s.get("modality"))


def extend_body(
    win: "ContextWindow",
    state: WindowState,
    meter: Meter,
    items: Sequence[Any],
    overlap: bool,
    workers: int,
) -> dict[str, Any]:
    """The ``extend`` operation's body (see the module docstring); returns the receipt fields."""
    ctx = win.context
    if isinstance(items, (str, bytes, Chunk, Mapping)) or not isinstance(items, Sequence):
        raise WindowError("extend takes a sequence of items (text, Chunk, or a dict of append() arguments)")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise WindowError(f"workers must be an int >= 1, got {workers!r}")
    plans = [_plan(win, meter, it) for it in items]
    # overflow="error": refuse before anything is encoded or loaded
    if ctx.overflow == "error" and plans:
        ingest.check_fits(ctx, sum(p.n_tokens for p in plans), state.tokens_used)
    store = ctx.store.store
    expect = {"expect_fingerprint": ctx.fingerprint, "expect_layout": ctx.layout.signature}
    futures: dict[int, Any] = {}
    prefetcher = Prefetcher(store, workers) if overlap and any(p.kind == "load" for p in plans) else None
    fallbacks: list[LoadFallback] = []
    stats: dict[str, Any] = {"overlapped": bool(overlap), "workers": workers, "load_s": 0.0, "wait_s": 0.0,
                             "compute_s": 0.0, "loads": 0, "misses": 0, "resident": 0, "given": 0}
    by_tier: Counter[str] = Counter()
    t_start = time.perf_counter()
    try:
        if prefetcher is not None:
            for i, p in enumerate(plans):
                if p.kind == "load":
                    futures[i] = prefetcher.submit(p.key, **expect)
            # the model's work that needs no loaded chunk: encode the misses while loads stream
            for p in plans:
                if p.kind == "miss":
                    t0 = time.perf_counter()
                    p.chunk = _encode(win, p, meter)
                    stats["compute_s"] += time.perf_counter() - t0
        refs: list[ChunkRef] = []
        left: list[ChunkRef] = []
        for i, p in enumerate(plans):
            stats[{"load": "loads", "miss": "misses"}.get(p.kind, p.kind)] += 1
            if p.kind == "load":
                t0 = time.perf_counter()
                got = futures[i].result() if i in futures else fetch(store, p.key, **expect)
                stats["wait_s"] += time.perf_counter() - t0
                stats["load_s"] += got.seconds
                chunk, error = None, got.error
                if got.ok:
                    try:
                        entry = settle(store, got, meter.traffic)
                        assert entry is not None
                        chunk = Chunk.from_entry(dict(entry.tensors), dict(entry.meta))
                        by_tier[str(got.tier)] += 1
                    except Exception as exc:  # a malformed entry: recompute like any failed load
                        error = exc
                elif error is None:
                    error = LookupError("the entry left the store before it was read")
                if chunk is None:
                    t0 = time.perf_counter()
                    store.delete(p.key, traffic=meter.traffic)  # the bad copy goes; the recomputed one replaces it
                    chunk = _encode(win, p, meter)
                    stats["compute_s"] += time.perf_counter() - t0
                    fb = LoadFallback(chunk.id, got.tier, f"{type(error).__name__}: {error}")
                    fallbacks.append(fb)
                    meter.notes.append(f"load of chunk {chunk.id[:12]} from {got.tier!r} failed ({fb.error}): recomputed")
                p.chunk = chunk
            elif p.kind == "resident":
                p.chunk = ctx.store.get_chunk(p.key, fingerprint=ctx.fingerprint, layout=ctx.layout.signature,
                                              traffic=meter.traffic)
                if p.chunk is None:  # evicted since it was looked up: compute it
                    p.chunk = _encode(win, p, meter)
            elif p.kind == "given":
                p.chunk = ingest.chunk_from_inputs(ctx, meter, chunk=p.chunk)
            elif p.chunk is None:  # a miss, sequential mode
                t0 = time.perf_counter()
                p.chunk = _encode(win, p, meter)
                stats["compute_s"] += time.perf_counter() - t0
            # append it and condition it on what precedes it (patch forms: model work)
            t0 = time.perf_counter()
            c = p.chunk
            new = Slot(ref=new_ref(c.id, c.n_tokens, p.spec.get("label")), chunk=c)
            ref = new.ref
            slots = list(state.slots)
            reasons: dict[ChunkRef, str] = {}
            left += win._make_room(state, slots, c.n_tokens, reasons)
            at = window_index(ctx, state.graph, slots, new, len(slots))  # the window's placement policy
            slots.insert(at, new)
            reasons[ref] = "append"
            for later in slots[at + 1:]:
                reasons.setdefault(later.ref, "inserted")
            state.slots, _ = reconcile(ctx, slots, reasons, meter)
            refs.append(ref)
            stats["compute_s"] += time.perf_counter() - t0
    finally:
        if prefetcher is not None:
            prefetcher.close()
    stats["wall_s"] = time.perf_counter() - t_start
    stats["by_tier"] = dict(by_tier)
    stats["fallbacks"] = len(fallbacks)
    gone = [r for r in refs if r in left]
    return {"refs": tuple(r for r in refs if r not in gone), "left": tuple(left), "load_fallbacks": tuple(fallbacks),
            "loading": stats}
