"""Import the public Mooncake FAST'25 request traces (kvcache-ai/Mooncake, ``FAST25-release/traces``).

Each Mooncake line is one request: ``timestamp`` (ms), ``input_length``, ``output_length`` and
``hash_ids``, the remapped hashes of the prompt's 512-token prefix blocks (equal ids = reusable
prefix KV). The conversion (see ``docs/replay.md`` for what it keeps and loses):

- one request -> one ``step`` (``t`` = its timestamp) followed by window edits and one ``query``;
- one hash id -> one chunk ``b<id>`` (content hash ``mooncake:<id>``) of 512 tokens, except a
  request's last block, which holds the remainder ``input_length - 512 * (n - 1)``;
- the window becomes the request's blocks in order: the longest leading run it shares with the
  window stays, every other in-window block is evicted, the request's remaining blocks are
  recalled (seen before) or arrive (new);
- the query is 1 token (the prompt's tokens are all in its blocks) with ``output_tokens`` =
  ``output_length``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..core.errors import TraceError
from .builder import TraceBuilder
from .events import TraceHeader
from .io import Trace, iter_lines

BLOCK_TOKENS = 512


def _field(raw: dict[str, Any], name: str, path: str, line: int, *, minimum: int) -> int:
    v = raw.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < minimum:
        raise TraceError(f"{name} must be an integer >= {minimum}, got {v!r}", path=path, line=line, field=name)
    return int(v)


def import_mooncake(path: str | os.PathLike, *, limit: int | None = None, block_tokens: int = BLOCK_TOKENS) -> Trace:
    """Convert a Mooncake trace file (``.jsonl``, ``.gz`` or ``.xz``) into a validated :class:`Trace`.

    ``limit``: convert only the first ``limit`` requests. Raises TraceError with the line number
    and field of the first malformed request; nothing is returned for a file that fails.
    """
    p = str(path)
    b = TraceBuilder(TraceHeader(generator="mooncake", agent="Mooncake FAST'25 request trace", meta={}))
    tokens_of: dict[int, int] = {}
    mismatches = 0
    requests = 0
    blocks_total = 0
    for line, text in iter_lines(p):
        if limit is not None and requests >= limit:
            break
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"not valid JSON ({exc.msg} at column {exc.colno})", path=p, line=line) from None
        if not isinstance(raw, dict):
            raise TraceError("a Mooncake request must be a JSON object", path=p, line=line)
        ts = _field(raw, "timestamp", p, line, minimum=0)
        n_in = _field(raw, "input_length", p, line, minimum=1)
        n_out = _field(raw, "output_length", p, line, minimum=0)
        ids = raw.get("hash_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids):
            raise TraceError(f"hash_ids must be a non-empty list of integers >= 0, got {str(ids)[:80]}", path=p, line=line, field="hash_ids")
        if len(set(ids)) != len(ids):
            raise TraceError("hash_ids repeats a block", path=p, line=line, field="hash_ids")
        last = n_in - block_tokens * (len(ids) - 1)
        if last < 1 or last > block_tokens:
            raise TraceError(
                f"input_length {n_in} does not fit {len(ids)} blocks of {block_tokens} tokens", path=p, line=line, field="input_length"
            )
        sizes = [block_tokens] * (len(ids) - 1) + [last]
        for h, n in zip(ids, sizes):
            if h in tokens_of and tokens_of[h] != n:
                mismatches += 1  # the first size seen stands (a trace chunk has one size)
            tokens_of.setdefault(h, n)
        want = [f"b{h}" for h in ids]
        keep = 0
        while keep < min(len(want), len(b.window)) and b.window[keep] == want[keep]:
            keep += 1
        b.step(t=float(ts))
        for cid in b.window[keep:][::-1]:
            b.evict(cid)
        for h, cid in zip(ids[keep:], want[keep:]):
            b.arrive(cid, tokens_of[h], f"mooncake:{h}")
        b.query(1, n_out)
        requests += 1
        blocks_total += len(ids)
    if requests == 0:
        raise TraceError("no requests in the Mooncake trace", path=p, line=1)
    b.header = b.header.model_copy(update={"meta": {
        "source": os.path.basename(p), "requests": requests, "blocks": blocks_total, "unique_blocks": len(tokens_of),
        "block_tokens": block_tokens, "size_mismatches": mismatches,
    }})
    return b.build(name=os.path.basename(p).split(".")[0])
