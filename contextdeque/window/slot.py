"""Slot: one chunk placed in the window (immutable; operations build new slots).

A slot holds the chunk's canonical (shared with the store and with forks), its conditioning
stack (the patches it carries and what each was formed on), its start position, and its
*page*: the KV the model sees, ``relocate(chunk, start, patch=stack)``. The page is computed
on first use (the rotation is deferred out of the window operation: a slide or reorder is
O(chunks), and the bytes are written once, when the model reads the window) and then cached on
the slot. Slots and pages are immutable, so a fork shares them until it changes a slot
(copy-on-write for free).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from ..core.chunk import Chunk, digest
from ..core.cooperative import checkpoint
from ..core.layout import KVLayout
from ..core.kv import LayerKV
from ..core.operator import relocate
from ..patch import PATCH_KINDS, Patch
from ..patch.keys import kv_state
from .ref import ChunkRef

# (antecedent ref, that antecedent's version when the patch was formed)
Tag = tuple[ChunkRef, str]


def _measure(kind: str) -> str:
    """Patch kinds that measure the same thing (KV(B | the ordered antecedents), one conditioned
    forward) describe the same state: a fresh recall patch and an append-time exact patch on the
    same antecedent states (the label "cond" is part of saved slot versions)."""
    return "cond" if PATCH_KINDS[kind].exact_on_prefix else kind


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
            _measure(p.kind),
            p.rank_k,
            p.rank_v,
            tuple(p.layers),
            tuple((r.key, v) for r, v in self.formed_on),
        )


@dataclass(frozen=True, eq=False)
class Slot:
    """One chunk in the window.

    ``layout``: set once the slot is placed (None: not placed yet, no page). ``page`` (lazy): per
    layer ``(k [H_k, T, d_k], v [H_v, T, d_v])`` placed at ``start`` in the model's compute dtype.
    ``stale``: flagged by a recall cascade under ``cascade_policy="flag"`` (its patch was formed on
    an antecedent state that no longer exists).
    ``inline_on``: non-empty for a *provisional* slot (latency-first append of new content): its
    ``chunk`` holds ``KV(B | inline_on)`` from the one conditioned forward a prefix cache would
    also run, not the canonical; ``heal`` computes the canonical and the patch later. A
    provisional slot carries no patch stack.
    """

    ref: ChunkRef
    chunk: Chunk
    stack: tuple[Conditioning, ...] = ()
    start: int = 0
    stale: bool = False
    layout: KVLayout | None = field(default=None, repr=False)
    inline_on: tuple[Tag, ...] = ()

    @property
    def provisional(self) -> bool:
        return bool(self.inline_on)

    def flagged(self, stale: bool) -> "Slot":
        """This slot with ``stale`` set (sharing the page if it was already computed)."""
        out = Slot(ref=self.ref, chunk=self.chunk, stack=self.stack, start=self.start, stale=stale, layout=self.layout,
                   inline_on=self.inline_on)
        if "page" in self.__dict__:
            out.__dict__["page"] = self.__dict__["page"]
        return out

    @property
    def placed(self) -> bool:
        return self.layout is not None

    @cached_property
    def page(self) -> tuple[LayerKV, ...] | None:
        """The KV the model sees for this slot (computed on first access, then shared)."""
        if self.layout is None:
            return None
        checkpoint()
        return tuple(self._relocated(None))

    def page_layer(self, layer: int) -> LayerKV | None:
        """Layer ``layer`` of :attr:`page` (the same values): from the page when it is computed,
        else that layer alone, relocated and patched now and not kept (a layer-wise reader)."""
        if self.layout is None:
            return None
        if "page" in self.__dict__:
            return self.__dict__["page"][layer]
        return self._relocated([layer])[0]

    def _relocated(self, layers: list[int] | None) -> list[LayerKV]:
        # the window checked its positions against the trained length (or was told to go beyond)
        return relocate(self.chunk, self.start, layout=self.layout, patch=list(self.patches) or None,
                        beyond_trained=True, layers=layers)

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
        inline = [("inline", tuple((r.key, v) for r, v in self.inline_on))] if self.inline_on else []
        return digest(self.chunk.id, [c.describe() for c in self.stack] + inline)[:16]

    @cached_property
    def state(self) -> str:
        """Content-addressed name of the slot's KV state (``patch.keys.kv_state``): its chunk and
        the store keys of its stack, independent of refs and windows. A provisional slot's state
        depends on what is in front of it: ``window.kvstate.slot_state``."""
        return kv_state(self.chunk.id, [c.key or c.patch.id for c in self.stack])

    @cached_property
    def conditioned_on(self) -> tuple[Tag, ...]:
        """The antecedents whose influence the slot's KV carries, in order (no duplicates).

        From the last absolute patch onwards: earlier patches' conditioning was replaced by it.
        A slot with no patch is blind (the canonical): ``()``; a provisional slot is conditioned
        on ``inline_on``.
        """
        if self.inline_on:
            return self.inline_on
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
        """Bytes of the placed page (from shapes: does not compute a deferred page)."""
        if self.layout is None:
            return 0
        item = torch.empty((), dtype=self.layout.torch_compute_dtype).element_size()
        return (self.chunk.keys.numel() + self.chunk.values.numel()) * item

    def positions(self) -> torch.Tensor:
        """``[n_axes, T]`` absolute positions of the slot's tokens."""
        return self.chunk.positions(self.start)
