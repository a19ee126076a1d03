"""Decoding: from slots to what the model reads (the assembled KV, a transformers ``Cache``, the
ids ``model.generate`` expects) and the answer to a query (``answer``: under a KV selection
policy or over the whole window; ``generate``: ``model.generate`` where it can continue the
cache, else a small greedy decoder with explicit positions).

transformers interop: ``model.generate(input_ids=full_ids, past_key_values=cache)`` feeds only
the tokens past the cache's length, at positions ``cache_len, cache_len + 1, ...``. So
``full_ids`` must cover the cached prefix (root + every chunk) plus the query, and the cache
length must equal the next position, which holds when every chunk's span equals its token
count (text). :func:`input_ids_for` builds those ids; windows holding image spans (span !=
token count) decode through :func:`greedy` instead, which passes positions explicitly.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..core import compat
from ..core.args import check_token_ids
from ..core.errors import PositionError, WindowError
from ..core.kv import LayerKV, concat_kv, kv_nbytes
from ..model import chat as chat_template
from .context import WindowContext
from .receipt import Meter
from .slot import Slot



def assemble(ctx: WindowContext, slots: Sequence[Slot], pages: dict[int, tuple[LayerKV, ...] | None] | None = None) -> list[LayerKV]:
    """Per layer ``(k [H_k, S, d_k], v [H_v, S, d_v])``: the root's KV then every slot's page, in
    order (``S = root_len + sum(n_tokens)``). ``pages`` overrides slot ``i``'s page (None:
    leave the slot out). Always fresh tensors: nothing returned aliases a page."""
    root = ctx.backend.root_kv()
    parts: list[Sequence[LayerKV]] = [root]
    for i, s in enumerate(slots):
        page = s.page if pages is None or i not in pages else pages[i]
        if page is None:
            continue
        parts.append(page)
    return concat_kv(parts, ctx.layout.torch_compute_dtype)


def assemble_layer(ctx: WindowContext, slots: Sequence[Slot], layer: int) -> LayerKV:
    """Layer ``layer`` of :func:`assemble` (the same values), computing only that layer of each
    slot's page: ``(k [H_k, S, d_k], v [H_v, S, d_v])``, fresh tensors."""
    parts: list[Sequence[LayerKV]] = [[ctx.backend.root_kv()[layer]]]
    parts += [[s.page_layer(layer)] for s in slots if s.placed]
    return concat_kv(parts, ctx.layout.torch_compute_dtype)[0]


def cache_config(ctx: WindowContext) -> Any:
    """The config to build caches with: only when the model has sliding layers (they must keep
    just their window, like a real prefill); otherwise every layer keeps every token."""
    if any(w is not None for w in ctx.layout.sliding_windows):
        return compat.text_config(ctx.backend.model.config)
    return None


def to_cache(ctx: WindowContext, layers: Sequence[LayerKV]) -> Any:
    """A transformers ``DynamicCache`` (batch 1) holding ``layers``."""
    return compat.cache_from_layers([(k.unsqueeze(0), v.unsqueeze(0)) for k, v in layers], config=cache_config(ctx))


def next_position(ctx: WindowContext, slots: Sequence[Slot]) -> int:
    return ctx.root_len + sum(s.span for s in slots)


def check_trained(ctx: WindowContext, end: int, what: str) -> None:
    """Refuse a window whose positions would reach ``end`` (exclusive) past the model's trained
    context, unless the window was opened with ``beyond_trained=True``."""
    limit = ctx.layout.max_trained_position
    if not ctx.beyond_trained and limit is not None and end > limit:
        raise PositionError(
            f"{what} would place tokens up to position {end - 1}, past the model's trained context "
            f"({limit} positions); slide or evict first, or open the window with beyond_trained=True"
        )


def query_ids(ctx: WindowContext, query: str | Sequence[int] | torch.Tensor, *, chat: bool = True) -> list[int]:
    """Token ids of ``query``: ids are taken as given; text is tokenized and, when the tokenizer
    has a chat template (and ``chat``), followed by the template's end of the user turn and the
    assistant header (the root opened the user turn)."""
    if not isinstance(query, str):
        if isinstance(query, torch.Tensor) and query.dim() == 2 and query.shape[0] == 1:
            query = query[0]  # [1, Q], as a tokenizer returns it
        return check_token_ids("query", query, ctx.backend.vocab_size, error=WindowError).tolist()
    backend = ctx.backend
    tok = backend.tokenizer
    if tok is None:
        raise WindowError("this backend has no tokenizer: pass the query as token ids")
    text = query
    if chat and chat_template.has_template(tok):
        text = query + chat_template.user_turn_suffix(tok)
    ids = backend.tokenize(text)
    if not ids:
        raise WindowError("empty query")
    return ids


def filler_id(ctx: WindowContext) -> int:
    tok = ctx.backend.tokenizer
    for attr in ("pad_token_id", "unk_token_id", "eos_token_id"):
        v = getattr(tok, attr, None) if tok is not None else None
        if v is not None:
            return int(v)
    return 0


def hf_compatible(slots: Sequence[Slot]) -> bool:
    """Whether ``model.generate`` can continue the materialized cache (positions = cache length)."""
    return all(s.span == s.n_tokens and s.chunk.rel_positions.shape[0] == 1 for s in slots)


def prefix_ids(ctx: WindowContext, slots: Sequence[Slot]) -> list[int]:
    """Ids of the cached prefix: root, then each chunk's token ids (an embeddings chunk has
    none; a filler id stands for each of its tokens — generate only counts them)."""
    ids = list(ctx.backend.root_ids)
    fill = filler_id(ctx)
    for s in slots:
        if s.chunk.token_ids is not None:
            ids.extend(int(i) for i in s.chunk.token_ids.tolist())
        else:
            ids.extend([fill] * s.n_tokens)
    return ids


def answer(
    ctx: WindowContext, slots: Sequence[Slot], query: Sequence[int], max_new_tokens: int, meter: Meter, **kw: Any
) -> list[int]:
    """The answer ids to ``query`` (ids) after ``slots``: under the context's KV selection policy
    (``kvselect.generate_selected``: decoding over the rows its selector keeps), else over the
    whole assembled window (:func:`generate`). Records the bytes read and what the selection did
    on ``meter``.

    Raises:
        PositionError: the query and answer would pass the model's trained context."""
    from .kvselect import generate_selected  # kvselect decodes through this module

    check_trained(ctx, next_position(ctx, slots) + len(query) + int(max_new_tokens), "generate")
    if ctx.kv_selection is not None:
        new_ids, info = generate_selected(ctx, slots, query, max_new_tokens, eos_ids(ctx), ctx.kv_selection)
        meter.page_bytes += info["bytes_kept"]
        meter.notes.append(
            f"kv selection {info['selector']}@{info['budget']}: kept {info['kept']} of {info['rows']} rows per KV head"
            if info["selected"] else f"kv selection {info['selector']}: {info['rows']} rows, under its threshold"
        )
        return new_ids
    layers = assemble(ctx, slots)
    meter.page_bytes += kv_nbytes(layers)
    return generate(ctx, slots, layers, query, max_new_tokens, **kw)


def generate(
    ctx: WindowContext, slots: Sequence[Slot], layers: Sequence[LayerKV], query: Sequence[int], max_new_tokens: int, **kw: Any
) -> list[int]:
    """The answer ids to ``query`` (ids) after the assembled ``layers`` of ``slots``. Text-only
    windows go through ``model.generate`` on the materialized cache (greedy unless ``kw`` says
    otherwise); windows with image spans through :func:`greedy` with explicit positions.
    Counts the decode forwards in ``ctx.counters``."""
    if not hf_compatible(slots):
        return greedy(ctx, layers, next_position(ctx, slots), query, max_new_tokens, eos_ids(ctx))[1]
    ids = torch.tensor([prefix_ids(ctx, slots) + list(query)], dtype=torch.long, device=ctx.backend.device)
    eos = eos_ids(ctx)
    gen_kw = {"do_sample": False, "max_new_tokens": int(max_new_tokens), "pad_token_id": eos[0] if eos else filler_id(ctx)}
    gen_kw.update(kw)
    with torch.no_grad():
        out = ctx.backend.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=to_cache(ctx, layers), **gen_kw
        )
    new_ids = [int(t) for t in out[0, ids.shape[1] :].tolist()]
    ctx.counters.decode_forwards += max(1, len(new_ids))
    ctx.counters.decode_tokens += len(query) + max(0, len(new_ids) - 1)
    return new_ids


@torch.no_grad()
def greedy(
    ctx: WindowContext,
    layers: Sequence[LayerKV],
    start: int,
    ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
) -> tuple[torch.Tensor, list[int]]:
    """Greedy decode of ``ids`` (the query) after the assembled ``layers``, the query's first
    token at position ``start``. Returns the fp32 logits ``[vocab]`` of the first answer token
    and the answer ids (stopping after an ``eos_ids`` token). Counts its forwards in
    ``ctx.counters``."""

    def count(n: int) -> None:
        ctx.counters.decode_forwards += 1
        ctx.counters.decode_tokens += n

    return greedy_steps(ctx.backend, to_cache(ctx, layers), int(layers[0][0].shape[1]), start, ids, max_new_tokens,
                        eos_ids, count)


@torch.no_grad()
def greedy_steps(
    backend: Any,
    cache: Any,
    past_len: int,
    start: int,
    ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    count: Callable[[int], None],
) -> tuple[torch.Tensor, list[int]]:
    """The one greedy decoding loop (the window's answers, the fidelity harness's scoring): prefill
    ``ids`` after a transformers ``cache`` of ``past_len`` rows, the first at position ``start``,
    then one forward per answer token, at most ``max_new_tokens`` (at least one), stopping after an
    ``eos_ids`` token. ``count(n_tokens)`` is told of every forward. Returns the fp32 logits
    ``[vocab]`` after the query (on the CPU) and the answer ids."""
    model = backend.model
    step_ids = torch.as_tensor(list(ids), dtype=torch.long, device=backend.device).reshape(1, -1)
    pos = start
    answer: list[int] = []
    first_logits: torch.Tensor | None = None
    eos = {int(e) for e in eos_ids}
    for step in range(max(1, int(max_new_tokens))):
        n = step_ids.shape[1]
        position_ids = backend.position_ids(backend.text_positions(pos, n))
        mask = torch.ones(1, past_len + n, dtype=torch.long, device=backend.device)
        out = model(
            input_ids=step_ids,
            position_ids=position_ids,
            past_key_values=cache,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=1,
        )
        count(n)
        cache = out.past_key_values
        logits = out.logits[0, -1].to(torch.float32)
        if first_logits is None:
            first_logits = logits.cpu()
        nxt = int(torch.argmax(logits))
        answer.append(nxt)
        past_len += n
        pos += n
        if nxt in eos or len(answer) >= max_new_tokens:
            break
        step_ids = torch.tensor([[nxt]], dtype=torch.long, device=backend.device)
    assert first_logits is not None
    return first_logits, answer


def eos_ids(ctx: WindowContext) -> list[int]:
    out: list[int] = []
    cfg = getattr(ctx.backend.model, "generation_config", None)
    for src in (cfg, ctx.backend.tokenizer):
        v = getattr(src, "eos_token_id", None) if src is not None else None
        if v is None:
            continue
        out.extend(int(x) for x in (v if isinstance(v, (list, tuple)) else [v]))
    return sorted(set(out))


def decode_text(ctx: WindowContext, ids: Sequence[int]) -> str | None:
    tok = ctx.backend.tokenizer
    if tok is None:
        return None
    return tok.decode(list(ids), skip_special_tokens=True)
