"""Slot: one chunk placed in the window (immutable; operations build new slots).

A slot holds the chunk's canonical (shared with the store and with forks), its conditioning
stack (the patches it carries and what each was formed on), its start position, and its
*page*: the KV the model sees, ``relocate(chunk, start, patch=stack)``. Pages are immutable
tensors, so a fork shares them until it changes a slot (copy-on-write for free).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..chunk import Chunk, digest
from ..operator import LayerKV
from ..patch import Patch
from .ref import ChunkRef

# (antecedent ref, that antecedent's version when the patch was formed)
Tag = tuple[ChunkRef, str]

# Patch kinds that measure the same thing (one conditioned forward on the antecedents): a fresh
# recall patch and an append-time exact patch on the same antecedent states are the same state.
_MEASURE = {"exact": "cond", "recall": "cond"}


@dataclass(frozen=True, eq=False)
class Conditioning:
    """One patch in a slot's stack.

    ``formed_on``: the antecedents (and their versions) in window order when it was formed.
    ``absolute``: after this patch the slot's content KV is ``KV(B | formed_on)`` (to the patch's
    rank): true for exact/recall/orbit patches and for full-rank removal patches; a low-rank
    removal patch only corrects part of what the earlier patches absorbed.
    ``reused``: served by the store rather than formed. ``key``: the patch's store key.
    """

    patch: Patch
    formed_on: tuple[Tag, ...]
    absolute: bool
    reused: bool = False
    key: str = ""

    def describe(self) -> tuple:
        p = self.patch
        return (
            _MEASURE.get(p.kind, p.kind),
            p.rank_k,
            p.rank_v,
            tuple(p.layers),
            tuple((r.key, v) for r, v in self.formed_on),
        )


@dataclass(frozen=True, eq=False)
class Slot:
    """One chunk in the window.

    ``page``: per layer ``(k [H_k, T, d_k], v [H_v, T, d_v])`` placed at ``start`` in the model's
    compute dtype (None until computed). ``stale``: flagged by a recall cascade under
    ``cascade_policy="flag"`` (its patch was formed on an antecedent state that no longer exists).
    """

    ref: ChunkRef
    chunk: Chunk
    stack: tuple[Conditioning, ...] = ()
    start: int = 0
    page: tuple[LayerKV, ...] | None = None
    stale: bool = False

    @property
    def patches(self) -> tuple[Patch, ...]:
        return tuple(c.patch for c in self.stack)

    @property
    def n_tokens(self) -> int:
        return self.chunk.n_tokens

    @property
    def span(self) -> int:
        return self.chunk.span

    @property
    def end(self) -> int:
        """The next free position after this slot."""
        return self.start + self.chunk.span

    @cached_property
    def version(self) -> str:
        """Identity of the slot's content KV (canonical + stack), independent of position."""
        return digest(self.chunk.id, [c.describe() for c in self.stack])[:16]

    @cached_property
    def conditioned_on(self) -> tuple[Tag, ...]:
        """The antecedents whose influence the slot's KV carries, in order (no duplicates).

        From the last absolute patch onwards: earlier patches' conditioning was replaced by it.
        A slot with no patch is blind (the canonical): ``()``.
        """
        start = 0
        for i, c in enumerate(self.stack):
            if c.absolute:
                start = i
        seen: dict[Tag, None] = {}
        for c in self.stack[start:]:
            for tag in c.formed_on:
                seen.setdefault(tag, None)
        return tuple(seen)

    @property
    def page_nbytes(self) -> int:
        if self.page is None:
            return 0
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.page)

    def positions(self) -> torch.Tensor:
        """``[n_axes, T]`` absolute positions of the slot's tokens."""
        return self.chunk.positions(self.start)
