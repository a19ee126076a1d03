"""Prefix cache: reuse only a byte-identical leading prefix of a previously cached request.

A radix/prefix cache (vLLM, SGLang) keeps the KV of whole requests and serves a new request from
the longest *leading* run of chunks it shares, in order, with one of them; everything after the
first difference is re-prefilled. Entries are keyed by model, root and the ordered digests of
the chunks' inputs.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from ...core.chunk import Chunk
from ...core.errors import ReuseArmError
from ...core.operator import relocate
from .base import ArmResult, ReuseArm, ReuseRequest
from ...core.kv import LayerKV, concat_kv, kv_nbytes



class PrefixCacheArm(ReuseArm):
    """Serve the longest cached leading prefix, re-prefill the rest, remember the request.

    ``max_entries``: requests kept (least recently used dropped first). ``remember=False`` serves
    without storing the new request (a read-only cache).
    """

    name = "prefix_cache"

    def __init__(self, *, max_entries: int = 64, remember: bool = True, label: str | None = None) -> None:
        super().__init__(label=label)
        if max_entries < 1:
            raise ReuseArmError("a prefix cache needs room for at least one entry")
        self.max_entries = int(max_entries)
        self.remember_requests = bool(remember)
        self._entries: OrderedDict[tuple[str, ...], list[LayerKV]] = OrderedDict()

    # ------------------------------------------------------------------ cache contents
    @staticmethod
    def _key(backend, chunks: Sequence[Chunk]) -> tuple[str, ...]:
        # the inputs' digest (token ids / embeddings and their position grid), not the chunk id:
        # a prefix cache matches what the model was fed, whatever dtype a canonical is stored in
        return (backend.fingerprint, backend.root_digest, *(c.meta.get("input_digest", c.id) for c in chunks))

    def remember(self, backend, chunks: Sequence[Chunk], kv: list[LayerKV]) -> None:
        """Store the KV of request ``[root, *chunks]`` (per layer ``[H, R + sum T, d]``)."""
        key = self._key(backend, chunks)
        self._entries[key] = [(k.clone(), v.clone()) for k, v in kv]
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def seed_canonicals(self, backend, chunks: Sequence[Chunk]) -> None:
        """Record each chunk's own encode request ``[root, chunk]`` (its canonical, exactly)."""
        for c in chunks:
            self.remember(backend, [c], concat_kv([backend.root_kv(), relocate(c, backend.root_len, layout=backend.layout)]))

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, backend, chunks: Sequence[Chunk]) -> tuple[int, tuple[str, ...] | None]:
        """``(n, key)``: the longest leading run of ``chunks`` some entry starts with, and that entry."""
        want = self._key(backend, chunks)
        best, best_key = 0, None
        for key in self._entries:
            m = 0
            while m < min(len(key), len(want)) and key[m] == want[m]:
                m += 1
            n = m - 2  # fingerprint and root digest are not chunks
            if n > best:
                best, best_key = n, key
        return best, best_key

    # ------------------------------------------------------------------ serve
    def run(self, request: ReuseRequest) -> ArmResult:
        be = request.backend
        chunks = request.chunks
        hit, key = self.lookup(be, chunks)
        R = request.root_len
        rep = self.new_report(request)
        if key is not None:
            self._entries.move_to_end(key)
            rows = request.offsets[hit] if hit < len(chunks) else R + request.n_chunk_tokens
            entry = self._entries[key]
            prefix = [(k[:, :rows], v[:, :rows]) for k, v in entry]
            rep.bytes_canonical = kv_nbytes(prefix)
        else:
            prefix = [(k.clone(), v.clone()) for k, v in be.root_kv()]
        if hit < len(chunks):
            start_tok = request.offsets[hit] - R
            idx = torch.arange(start_tok, request.n_chunk_tokens)
            res = be.forward(**request.inputs(idx), positions=request.positions()[:, idx], past=prefix, logits="none")
            kv = concat_kv([prefix, res.kv])
            rep.forwards = 1
            rep.tokens_prefilled = rep.tokens_recomputed = int(idx.numel())
            rep.token_layers = int(idx.numel()) * request.num_layers
        else:
            kv = prefix
        rep.extras["prefix_chunks_hit"] = hit
        if self.remember_requests:
            self.remember(be, chunks, kv)
            rep.extras["bytes_cached"] = kv_nbytes(kv)
        return ArmResult(kv=kv, next_position=request.next_position, report=rep)
