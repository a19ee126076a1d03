"""What a serving engine's connector needs from contextdeque without importing the engine: its
paged KV layouts, and a prompt's token ids cut into the window's root and message chunks.

**Paged layouts.** An engine keeps each layer's KV in fixed-size blocks; a request's block table
maps its logical block ``i`` (sequence positions ``[i*B, (i+1)*B)``) to a physical block. Where
and how a token's K and V sit inside a block differs per engine backend, so a connector writes
and reads through :class:`PagedLayout`:

- :class:`CpuPagedLayout`, vLLM's CPU attention: one tensor ``[num_blocks, H, B, 2*d]`` per layer;
  per block and head the first ``B*d`` values are K **transposed** (``[d, B]``), the next ``B*d``
  are V (``[B, d]``).
- :class:`FlashPagedLayout`, vLLM's GPU flash-attention layout: ``[2, num_blocks, B, H, d]`` (K
  then V); written by contextdeque's fused kernel through its ``PagedDest``.

**The cut.** vLLM hands a connector the prompt's token ids only. A chat prompt is the chat
template's rendering of a messages list, and every rendered message opens with the same tokens
(ChatML's ``<|im_start|>``): :class:`PromptCutter` reads those opening tokens and the generation
prompt off the tokenizer's own template (through ``contextdeque.agents.ChatTemplate``, the cut
``MessageWindow`` uses), then cuts ids into the root (everything up to the second message: BOS,
the system message), one chunk per later message, and the tail (the generation prompt). The
chunks are the ones a ``MessageWindow`` over the same messages appends, so their content
addresses (chunk ids) are the same and both find each other's canonicals in a shared store.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..core.errors import ArgumentError, TemplateError
from ..kernels import PagedDest, fused_apply, slot_mapping_from_block_table


# ---------------------------------------------------------------------------- paged layouts


class PagedLayout(ABC):
    """How one layer's paged cache holds token ``p`` of a sequence (see the module docstring).

    Shapes: ``k``, ``v`` are ``[H, T, d]``; ``block_ids`` the sequence's block table (physical
    block of each logical block); ``start`` the sequence position of the first token.
    """

    name = "paged"

    def __init__(self, block_size: int, num_heads: int, head_dim: int) -> None:
        if block_size <= 0 or num_heads <= 0 or head_dim <= 0:
            raise ArgumentError(f"a paged layout needs positive sizes, got block {block_size}, heads {num_heads}, dim {head_dim}")
        self.block_size = int(block_size)
        self.num_heads = int(num_heads)
        self.head_dim = int(head_dim)

    def _where(self, block_ids: Sequence[int], start: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Physical block and offset in it of sequence positions ``[start, start + n)``."""
        table = torch.as_tensor(list(block_ids), dtype=torch.int64, device=device)
        slots = slot_mapping_from_block_table(table, int(start), int(n), self.block_size)
        return slots // self.block_size, slots % self.block_size

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        want = (self.num_heads, self.head_dim)
        if k.dim() != 3 or v.dim() != 3 or (k.shape[0], k.shape[2]) != want or (v.shape[0], v.shape[2]) != want or k.shape[1] != v.shape[1]:
            raise ArgumentError(f"{self.name} layout holds [H={want[0]}, T, d={want[1]}] K and V, got {tuple(k.shape)} / {tuple(v.shape)}")

    @abstractmethod
    def write(self, cache: torch.Tensor, block_ids: Sequence[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put ``k``, ``v`` (``[H, T, d]``, as the model caches them) at positions
        ``[start, start + T)``; nothing else in ``cache`` changes."""

    @abstractmethod
    def read(self, cache: torch.Tensor, block_ids: Sequence[int], start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k [H, n, d], v [H, n, d])`` of positions ``[start, start + n)`` (fresh tensors)."""


class CpuPagedLayout(PagedLayout):
    """vLLM's CPU attention cache ``[num_blocks, H, B, 2*d]``: per block and head, K transposed
    (``[d, B]``) then V (``[B, d]``)."""

    name = "vllm-cpu"

    def _halves(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``kt [NB, H, d, B]`` (K transposed) and ``vv [NB, H, B, d]`` of ``cache``."""
        nb, H, B, d = cache.shape[0], self.num_heads, self.block_size, self.head_dim
        if tuple(cache.shape) != (nb, H, B, 2 * d) or not cache.is_contiguous():
            raise ArgumentError(f"the vLLM CPU cache is a contiguous [blocks, {H}, {B}, {2 * d}] tensor, got {tuple(cache.shape)}")
        halves = cache.view(nb, H, 2, B * d)
        return halves[:, :, 0].view(nb, H, d, B), halves[:, :, 1].view(nb, H, B, d)

    def write(self, cache: torch.Tensor, block_ids: Sequence[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check(k, v)
        kt, vv = self._halves(cache)
        blk, off = self._where(block_ids, start, k.shape[1], cache.device)
        # advanced indices on dims split by slices put the token dim first: [T, H, d]
        kt[blk, :, :, off] = k.transpose(0, 1).to(cache.dtype)
        vv[blk, :, off, :] = v.transpose(0, 1).to(cache.dtype)

    def read(self, cache: torch.Tensor, block_ids: Sequence[int], start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        kt, vv = self._halves(cache)
        blk, off = self._where(block_ids, start, n, cache.device)
        return kt[blk, :, :, off].transpose(0, 1).contiguous(), vv[blk, :, off, :].transpose(0, 1).contiguous()


class FlashPagedLayout(PagedLayout):
    """vLLM's GPU flash-attention cache ``[2, num_blocks, B, H, d]``: written by the fused kernel
    (its ``PagedDest``: slot ``block * B + offset``), so a CUDA build relocates straight into it."""

    name = "vllm-flash"

    def _dest(self, cache: torch.Tensor, block_ids: Sequence[int], start: int, n: int) -> PagedDest:
        if cache.dim() != 5 or cache.shape[0] != 2 or tuple(cache.shape[2:]) != (self.block_size, self.num_heads, self.head_dim):
            raise ArgumentError(
                f"the flash-attention cache is [2, blocks, {self.block_size}, {self.num_heads}, {self.head_dim}], got {tuple(cache.shape)}"
            )
        table = torch.as_tensor(list(block_ids), dtype=torch.int64, device=cache.device)
        return PagedDest(cache[0], cache[1], slot_mapping_from_block_table(table, int(start), int(n), self.block_size))

    def write(self, cache: torch.Tensor, block_ids: Sequence[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check(k, v)
        fused_apply(k.contiguous(), v.contiguous(), None, None, None, dest=self._dest(cache, block_ids, start, k.shape[1]))

    def read(self, cache: torch.Tensor, block_ids: Sequence[int], start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self._dest(cache, block_ids, start, n).slot_mapping
        blk, off = slots // self.block_size, slots % self.block_size
        return cache[0][blk, off].transpose(0, 1).contiguous(), cache[1][blk, off].transpose(0, 1).contiguous()


def paged_layout_for(cache: torch.Tensor, block_size: int, num_heads: int, head_dim: int) -> PagedLayout:
    """The layout of an engine's per-layer cache tensor, told by its shape.

    Raises:
        UnsupportedLayoutError: a cache shaped like none of the known layouts.
    """
    from ..core.errors import UnsupportedLayoutError

    shape = tuple(cache.shape)
    if len(shape) == 4 and shape[1:] == (num_heads, block_size, 2 * head_dim):
        return CpuPagedLayout(block_size, num_heads, head_dim)
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == (block_size, num_heads, head_dim):
        return FlashPagedLayout(block_size, num_heads, head_dim)
    raise UnsupportedLayoutError(
        f"a paged KV cache shaped {shape} (block {block_size}, {num_heads} KV heads of {head_dim}) matches no layout "
        "contextdeque writes (vLLM CPU [blocks, H, B, 2d], flash-attention [2, blocks, B, H, d])",
        reason="paged-layout",
    )


# ---------------------------------------------------------------------------- the prompt's cut


@dataclass(frozen=True)
class PromptCut:
    """A prompt's token ids cut along the chat template: ``root`` (BOS and the first message),
    ``chunks`` (one per later whole message, in order) and ``tail`` (what follows the last whole
    message: the generation prompt, or an unfinished message)."""

    root: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    tail: tuple[int, ...]

    def prefix_len(self, n_chunks: int) -> int:
        """Tokens of the root and the first ``n_chunks`` chunks."""
        return len(self.root) + sum(len(c) for c in self.chunks[:n_chunks])


class PromptCutter:
    """Cuts chat prompts (token ids) into root, message chunks and tail, as ``MessageWindow`` cuts
    the messages list the prompt was rendered from.

    Raises:
        TemplateError: the tokenizer has no chat template, or its messages share no opening
            tokens (a prompt of such a template cannot be cut from its ids alone).
    """

    def __init__(self, tokenizer: Any) -> None:
        from ..session import ChatTemplate, normalize_messages

        template = ChatTemplate(tokenizer)
        probe = normalize_messages([
            {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"},
        ])
        cut = template.cut(probe)
        heads = [run[0] for run in cut.pieces if run and not isinstance(run[0], int)]
        opener: tuple[int, ...] = heads[0] if heads else ()
        for h in heads[1:]:
            n = 0
            while n < min(len(opener), len(h)) and opener[n] == h[n]:
                n += 1
            opener = opener[:n]
        if not opener:
            raise TemplateError("the chat template's messages share no opening tokens: prompts cannot be cut from their ids")
        self.opener = opener
        self.generation = tuple(cut.generation_ids)

    def _starts(self, ids: Sequence[int]) -> list[int]:
        o, n = self.opener, len(self.opener)
        first = o[0]
        return [i for i, t in enumerate(ids) if t == first and tuple(ids[i : i + n]) == o]

    def cut(self, ids: Sequence[int]) -> PromptCut | None:
        """The cut of ``ids``, or None when they are not a chat prompt of this template (fewer than
        two messages before the tail)."""
        ids = tuple(int(t) for t in ids)
        starts = self._starts(ids)
        if len(starts) < 2:
            return None
        # the root ends where the second message opens; every later opener starts a chunk, and the
        # last run is the tail (the generation prompt, or a message still open)
        bounds = starts[1:] + [len(ids)]
        root = ids[: bounds[0]]
        runs = [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        if not runs:
            return None
        return PromptCut(root=root, chunks=tuple(runs[:-1]), tail=runs[-1])
