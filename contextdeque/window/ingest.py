"""Ingest: from what an agent appends (text, token ids, embeddings, an image, an encoded chunk)
to a stored canonical chunk, running the encoder (or the vision tower) only for content the
store has not seen; and, for latency-first appends, a provisional chunk from one conditioned
forward whose canonical is computed later."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..core.args import check_instance, check_int, check_str, check_token_ids
from ..core.chunk import Chunk
from ..core.errors import ArgumentTypeError, BudgetError, FingerprintMismatchError, WindowError
from ..core.kv import concat_kv
from ..core.operator import to_content_frame
from ..model import vision
from ..model.vision import pixel_key
from . import decode
from .context import WindowContext
from .plan import Encode, Forward, Load
from .receipt import Meter
from .ref import ChunkRef, new_ref
from .slot import Slot
from .store import WindowStore


@dataclass(frozen=True)
class Unencoded:
    """Content the store does not hold yet, not encoded (a latency-first append)."""

    chunk_id: str
    n_tokens: int
    inputs: dict[str, Any]


def image_embedding(ctx: WindowContext, image: Any, processor: Any, meter: Meter) -> Any:
    """The vision tower's output for ``image``: from the store (keyed by the pixels and the
    processor settings), or computed once and stored, so the tower never re-runs on pixels it
    has seen."""
    if processor is None:
        raise WindowError("image= needs the model's image processor (processor=)")
    key = pixel_key(image, processor)
    found = ctx.store.get_embeds(ctx.fingerprint, key, traffic=meter.traffic)
    if found is not None:
        return found
    emb = vision.image_embedding(ctx.backend, image, processor)
    ctx.counters.vision_encodes += 1
    meter.notes.append(f"vision tower ran ({emb.embeds.shape[0]} tokens)")
    ctx.store.put_embeds(ctx.fingerprint, emb, traffic=meter.traffic)
    return emb

def check_inputs(
    ctx: WindowContext,
    *,
    text: Any = None,
    token_ids: Any = None,
    embeds: Any = None,
    chunk: Any = None,
    rel_positions: Any = None,
    span: Any = None,
    modality: Any = None,
    label: Any = None,
) -> dict[str, Any]:
    """``append``'s content arguments checked and normalized (``token_ids`` as a 1-D int64
    tensor of in-vocabulary ids; ``embeds`` as a ``[T, hidden]`` float tensor of the model's
    width), before any work: a mistake raises ``ArgumentTypeError`` / ``WindowError`` naming the
    argument."""
    check_str("text", text, none_ok=True)
    check_str("label", label, none_ok=True)
    check_str("modality", modality, none_ok=True)
    check_instance("chunk", chunk, Chunk, "a contextdeque Chunk", none_ok=True)
    if text is not None and not text:
        raise WindowError("text is empty: a chunk needs at least one token")
    if text is not None and ctx.chunk_template != "{text}":
        text = ctx.chunk_template.format(text=text, label=label or "")
    if token_ids is not None:
        token_ids = check_token_ids("token_ids", token_ids, ctx.backend.vocab_size, error=WindowError)
    if embeds is not None:
        check_instance("embeds", embeds, torch.Tensor, "a [T, hidden] float tensor")
        if not embeds.is_floating_point():
            raise ArgumentTypeError(f"embeds must be a float tensor, got {embeds.dtype}")
        width = ctx.backend.embed_dim
        if embeds.dim() != 2 or embeds.shape[0] == 0 or embeds.shape[1] != width:
            raise WindowError(f"embeds must be [T >= 1, {width}] (the model's embedding width), got {tuple(embeds.shape)}")
        if not bool(torch.isfinite(embeds).all()):
            raise WindowError("embeds holds a non-finite value (inf/NaN)")
    if rel_positions is not None:
        check_instance("rel_positions", rel_positions, torch.Tensor, "an integer [n_axes, T] tensor")
        if rel_positions.is_floating_point() or rel_positions.dim() not in (1, 2):
            raise WindowError(f"rel_positions must be an integer [n_axes, T] tensor, got {rel_positions.dtype} {tuple(rel_positions.shape)}")
    check_int("span", span, minimum=1, none_ok=True, error=WindowError)
    return {"text": text, "token_ids": token_ids, "embeds": embeds, "chunk": chunk,
            "rel_positions": rel_positions, "span": span, "modality": modality}


def check_template(template: Any) -> None:
    """A chunk template: a str holding ``{text}`` (and optionally ``{label}``), nothing else."""
    check_str("chunk_template", template, error=WindowError)
    try:
        probe = template.format(text="\x00", label="")
    except (KeyError, IndexError, ValueError) as e:
        raise WindowError(f"chunk_template may use only {{text}} and {{label}}: {template!r} ({e})") from None
    if probe.count("\x00") != 1:
        raise WindowError(f"chunk_template must contain {{text}} exactly once, got {template!r}")


def chunk_from_inputs(
    ctx: WindowContext,
    meter: Meter,
    *,
    text: str | None = None,
    token_ids: Sequence[int] | torch.Tensor | None = None,
    embeds: torch.Tensor | None = None,
    chunk: Chunk | None = None,
    rel_positions: torch.Tensor | None = None,
    span: int | None = None,
    modality: str | None = None,
    image: Any = None,
    processor: Any = None,
    defer_encode: bool = False,
    used_tokens: int | None = None,
) -> "Chunk | Unencoded":
    """The canonical for the given content: from the store, or encoded once and stored (with
    ``defer_encode``, content the store lacks comes back unencoded). ``used_tokens``: the tokens
    the window holds now, so ``overflow="error"`` refuses before anything is encoded."""
    if image is not None:
        if any(x is not None for x in (text, token_ids, embeds, chunk)):
            raise WindowError("append needs exactly one of text=, token_ids=, embeds=, image=, chunk=")
        img = image_embedding(ctx, image, processor, meter)
        embeds, rel_positions, span, modality = img.embeds, img.rel_positions, img.span, "image"
    given = sum(x is not None for x in (text, token_ids, embeds, chunk))
    if given != 1:
        raise WindowError("append needs exactly one of text=, token_ids=, embeds=, chunk=")
    if chunk is not None:
        if not isinstance(chunk, Chunk):
            raise WindowError(f"chunk= must be a contextdeque Chunk, got {type(chunk).__name__}")
        check_chunk(ctx, chunk)
        check_fits(ctx, chunk.n_tokens, used_tokens)
        key = WindowStore.chunk_key(chunk)
        if not ctx.store.has(key):
            ctx.store.put_chunk(chunk, traffic=meter.traffic)
        stored = ctx.store.get_chunk(key, fingerprint=ctx.fingerprint, layout=ctx.layout.signature, traffic=meter.traffic)
        return stored if stored is not None else chunk
    if text is not None:
        token_ids = ctx.backend.tokenize(text)
    n = int(torch.as_tensor(token_ids).numel()) if token_ids is not None else int(embeds.shape[0])
    check_fits(ctx, n, used_tokens)  # before encoding: a chunk that can never fit costs nothing
    cid = ctx.backend.chunk_id_for(
        token_ids=token_ids, embeds=embeds, rel_positions=rel_positions, span=span, storage=ctx.storage
    )
    key = WindowStore.chunk_key(cid, ctx.fingerprint)
    q0 = len(meter.traffic.quarantined)
    found = load_canonical(ctx, key, meter)
    if found is not None:
        return found
    inputs = {"token_ids": token_ids, "embeds": embeds, "rel_positions": rel_positions, "span": span, "modality": modality}
    if len(meter.traffic.quarantined) > q0:  # the stored copy was corrupt: the content in hand rebuilds it
        if defer_encode:
            meter.repairs.append(f"chunk {cid[:12]}: corrupt stored copy quarantined; rebuilt from the appended content")
        else:
            return rebuilt(ctx, meter, inputs, "its stored copy was corrupt")
    if defer_encode:
        return Unencoded(cid, n, inputs)
    return encode_and_store(ctx,meter, **inputs)

def encode_and_store(ctx: WindowContext, meter: Meter, **inputs: Any) -> Chunk:
    """Encode a canonical (one forward after the root), store it, return the stored copy."""
    encoded = ctx.backend.encode(storage=ctx.storage, **inputs)
    ctx.counters.encodes += 1
    key = ctx.store.put_chunk(encoded, traffic=meter.traffic)
    meter.plan.add(Encode(encoded.id, encoded.n_tokens, tier=ctx.store.tier_of(key) or "none", nbytes=encoded.nbytes))
    stored = ctx.store.get_chunk(key, fingerprint=ctx.fingerprint, layout=ctx.layout.signature, traffic=meter.traffic)
    return stored if stored is not None else encoded

def source_of(chunk: Chunk) -> dict[str, Any]:
    """What re-encodes ``chunk``'s canonical (its inputs, no KV): ``encode_and_store(**source)``."""
    return {"token_ids": chunk.token_ids, "embeds": chunk.embeds, "rel_positions": chunk.rel_positions,
            "span": chunk.span, "modality": chunk.modality}


def rebuilt(ctx: WindowContext, meter: Meter, source: dict[str, Any], what: str) -> Chunk:
    """Re-encode a canonical the store lost or held corrupt, from its ``source``; the receipt's
    ``repairs`` says so."""
    chunk = encode_and_store(ctx, meter, **source)
    meter.repairs.append(f"re-encoded chunk {chunk.id[:12]} ({what}) from its source")
    return chunk


def load_canonical(ctx: WindowContext, key: str, meter: Meter) -> Chunk | None:
    """The canonical stored under ``key`` (None: not stored); one read out of a slower tier is a
    ``Load`` of the operation's plan (the store promotes it to the fastest tier)."""
    found = ctx.store.get_chunk(key, fingerprint=ctx.fingerprint, layout=ctx.layout.signature, traffic=meter.traffic)
    tier = meter.traffic.served_from
    if found is not None and tier is not None and tier != ctx.store.tier_names[0]:
        meter.plan.add(Load(found.id, found.n_tokens, tier=tier, nbytes=found.nbytes))
    return found


def canonical_of(ctx: WindowContext, provisional: Chunk, meter: Meter) -> Chunk:
    """The canonical of a provisional chunk: from the store, else encoded now."""
    found = load_canonical(ctx, WindowStore.chunk_key(provisional), meter)
    if found is not None:
        return found
    return encode_and_store(ctx,
        meter, token_ids=provisional.token_ids, embeds=provisional.embeds, rel_positions=provisional.rel_positions,
        span=provisional.span, modality=provisional.modality,
    )

def provisional(ctx: WindowContext, pending: Unencoded, prefix: Sequence[Slot], meter: Meter, label: str | None = None,
                ref: ChunkRef | None = None) -> Slot:
    """New content placed after ``prefix`` with one conditioned forward (what a prefix cache
    runs): a provisional slot holding ``KV(B | prefix)`` in the content frame. ``ref``: the slot's
    ref when the content is already the window's (a re-forward, a recall), else a new one."""
    return provisional_run(ctx, [pending], prefix, meter, refs=[ref], label=label)[0]


def provisional_run(ctx: WindowContext, pendings: Sequence[Unencoded], prefix: Sequence[Slot], meter: Meter,
                    refs: Sequence[ChunkRef | None], label: str | None = None) -> list[Slot]:
    """``pendings`` placed one after the other behind ``prefix`` by ONE conditioned forward of
    their concatenation: each a provisional slot holding ``KV(B_j | prefix, B_1 .. B_j-1)``, the
    KV a forward of each behind the ones before it gives (causal attention: a chunk's KV does not
    depend on what follows it), paying one forward's fixed cost. The plan records a ``Forward``
    per chunk, those after the first ``joined`` (no forward of their own). ``refs``: each slot's
    ref (None: a new one)."""
    backend = ctx.backend
    start = decode.next_position(ctx, prefix)
    context = sum(s.n_tokens for s in prefix)
    probes, positions, starts = [], [], []
    for pending in pendings:
        inp = pending.inputs
        probe = backend._encode_inputs(None, inp["token_ids"], inp["embeds"], inp["rel_positions"], inp["span"], ctx.storage)
        probes.append(probe)
        positions.append(probe.rel_positions + start)
        starts.append(start)
        start += probe.span
    past = concat_kv([backend.root_kv(), *(s.page for s in prefix)])
    if all(p.token_ids is not None for p in probes):
        input_ids, embeds = torch.cat([p.token_ids for p in probes]), None
    else:  # a mixed run: the token chunks as the model's input embeddings, beside the others' embeddings
        first = next(p["embeds"] for p in (q.inputs for q in pendings) if p["embeds"] is not None)
        input_ids, embeds = None, torch.cat([
            backend.embed_tokens(p.token_ids).to(first.dtype) if p.token_ids is not None
            else q.inputs["embeds"].to(device=backend.device, dtype=first.dtype) for p, q in zip(probes, pendings)])
        embeds = embeds.to(device=backend.device)
    res = backend.forward(input_ids=input_ids, inputs_embeds=embeds, positions=torch.cat(positions, dim=-1),
                          past=past, logits="none")
    out: list[Slot] = []
    at = 0
    for j, (pending, probe, pos, first_pos) in enumerate(zip(pendings, probes, positions, starts)):
        n = pos.shape[-1]
        keys, values = to_content_frame([(k[..., at:at + n, :], v[..., at:at + n, :]) for k, v in res.kv], ctx.layout, pos)
        at += n
        inp = pending.inputs
        meter.plan.add(Forward(pending.chunk_id, pending.n_tokens, context=context, joined=j > 0))
        context += pending.n_tokens
        chunk = Chunk(
            id=pending.chunk_id, fingerprint=ctx.fingerprint, layout_signature=ctx.layout.signature,
            root_digest=backend.root_digest, keys=keys.to(ctx.storage).contiguous(),
            values=values.to(ctx.storage).contiguous(), rel_positions=probe.rel_positions, span=probe.span,
            canonical_start=first_pos,
            token_ids=probe.token_ids,
            embeds=None if inp["embeds"] is None else inp["embeds"].detach().to("cpu").clone(),
            modality=inp["modality"] or ("text" if probe.token_ids is not None else "image"),
            meta={"input_digest": probe.input_digest, "provisional": "1"},
        )
        ref = refs[j] if refs[j] is not None else new_ref(chunk.id, chunk.n_tokens, label)
        out.append(Slot(ref=ref, chunk=chunk, inline_on=tuple((s.ref, s.version) for s in [*prefix, *out])))
    return out


def reforward(ctx: WindowContext, slot: Slot, prefix: Sequence[Slot], meter: Meter) -> Slot:
    """A provisional slot conditioned anew behind ``prefix``: one conditioned forward of its
    content, and still no canonical (a stored patch would need the canonical's forward as well)."""
    return reforward_run(ctx, [slot], prefix, meter)[0]


def reforward_run(ctx: WindowContext, run: Sequence[Slot], prefix: Sequence[Slot], meter: Meter) -> list[Slot]:
    """Provisional slots ``run`` (consecutive in the window) conditioned anew behind ``prefix``,
    each behind the ones before it: one forward of their concatenation (:func:`provisional_run`)."""
    pendings = [Unencoded(s.chunk.id, s.n_tokens, source_of(s.chunk)) for s in run]
    return provisional_run(ctx, pendings, prefix, meter, refs=[s.ref for s in run])

def check_chunk(ctx: WindowContext, chunk: Chunk) -> None:
    """Refuse a chunk encoded by another model, layout or root."""
    if chunk.fingerprint != ctx.fingerprint or chunk.layout_signature != ctx.layout.signature:
        raise FingerprintMismatchError(
            f"chunk {chunk.id[:12]} was encoded by model {chunk.fingerprint[:12]} (layout "
            f"{chunk.layout_signature}); this window runs {ctx.fingerprint[:12]} ({ctx.layout.signature})"
        )
    if chunk.root_digest != ctx.backend.root_digest:
        raise FingerprintMismatchError(
            f"chunk {chunk.id[:12]} was encoded after another root ({chunk.root_digest}) than this "
            f"window's ({ctx.backend.root_digest}); its canonical would not be KV(B | root)"
        )

def check_fits(ctx: WindowContext, n_tokens: int, used_tokens: int | None = None) -> None:
    """Refuse a chunk that could never fit the window's budget, however much slid out; with
    ``overflow="error"`` and the tokens in use given, also one that does not fit now."""
    budget = ctx.budget_tokens
    if budget is not None and n_tokens > budget:
        raise BudgetError(f"a chunk of {n_tokens} tokens cannot fit a window budget of {budget} tokens")
    if budget is not None and used_tokens is not None and ctx.overflow == "error" and used_tokens + n_tokens > budget:
        raise BudgetError(
            f"{n_tokens} more tokens exceed the budget ({used_tokens} of {budget} used); "
            "slide or evict first, or use overflow='slide'"
        )
