"""Side-by-side measurements a session and every agent report: the window's next-token logits
and time to first token against a full re-prefill of the same contents, and what a prefix cache
would prefill.

The re-prefill is the backend's oracle (``HFBackend.reprefill``: one forward over the root and
every chunk of the window, in order, nothing reused) followed by the query; the window side is
``materialize()`` followed by the same query. Both sides are timed in the same process, one after
the other. Nothing here imports the evaluation package: a server or an agent measures at run time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import torch

from contextdeque.core import compat
from contextdeque.core.kv import LayerKV


@dataclass
class FirstToken:
    """Next-token logits ``[vocab]`` (fp32) after a query, and the milliseconds it took to get them
    (``prefill_ms``: the KV before the query; ``ms``: everything up to the first token)."""

    logits: torch.Tensor
    ms: float
    prefill_ms: float
    tokens_prefilled: int


def window_layers(window: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The window's KV as per-layer ``(k [H, S, d], v [H, S, d])``, read from ``materialize()``."""
    cache = window.materialize()
    return [tuple(t[0] for t in compat.cache_layer(cache, i)) for i in range(compat.cache_num_layers(cache))]  # type: ignore[misc]


def query_logits(backend: Any, layers: Sequence[LayerKV], start: int, query_ids: Sequence[int]) -> torch.Tensor:
    """Next-token logits ``[vocab]`` (fp32) after prefilling ``query_ids`` at positions ``start..``
    behind ``layers`` (per layer ``(k [H, S, d], v [H, S, d])``): one forward of the backend."""
    q = [int(t) for t in query_ids]
    res = backend.forward(input_ids=q, positions=backend.text_positions(start, len(q)), past=list(layers), logits="last")
    return res.logits[0]


def window_first_token(window: Any, query_ids: Sequence[int]) -> FirstToken:
    """Logits after ``query_ids`` on the window as it stands (materialize + one forward over the query)."""
    t0 = time.perf_counter()
    layers = window_layers(window)
    t1 = time.perf_counter()
    logits = query_logits(window.backend, layers, window.next_position(), query_ids)
    t2 = time.perf_counter()
    return FirstToken(logits, (t2 - t0) * 1000.0, (t1 - t0) * 1000.0, len(query_ids))


def reprefill_first_token(window: Any, query_ids: Sequence[int]) -> FirstToken:
    """Logits after ``query_ids`` when the window's contents (root + every chunk, in order) are
    prefilled from scratch: what a server without reuse runs for this request."""
    backend = window.backend
    t0 = time.perf_counter()
    chunks = [window.chunk(r) for r in window.refs]
    if chunks:
        layers = [(k.clone(), v.clone()) for k, v in backend.reprefill(chunks).kv]
        start = backend.root_len + sum(c.span for c in chunks)
    else:
        layers = [(k.clone(), v.clone()) for k, v in backend.root_kv()]
        start = backend.root_len
    t1 = time.perf_counter()
    logits = query_logits(backend, layers, start, query_ids)
    t2 = time.perf_counter()
    n = backend.root_len + sum(c.n_tokens for c in chunks) + len(query_ids)
    return FirstToken(logits, (t2 - t0) * 1000.0, (t1 - t0) * 1000.0, n)


def common_prefix(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the longest common prefix of two token streams."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def window_stream(window: Any) -> list[Hashable]:
    """The window's contents as a prefix cache sees them: the root's token ids, then every chunk's
    token ids (an embeddings chunk, e.g. an image, as one opaque item per token, named by its
    chunk id)."""
    out: list[Hashable] = list(window.root_ids)
    for r in window.refs:
        c = window.chunk(r)
        if c.token_ids is not None:
            out.extend(int(t) for t in c.token_ids.tolist())
        else:
            out.extend((c.id, j) for j in range(c.n_tokens))
    return out


__all__ = [
    "FirstToken",
    "query_logits",
    "window_layers",
    "window_first_token",
    "reprefill_first_token",
    "common_prefix",
    "window_stream",
]
