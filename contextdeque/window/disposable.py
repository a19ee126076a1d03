"""The disposability test: is a chunk's conditioning (or the chunk itself) load-bearing for a
pending query?

Conditioning is a switch (paper, App. E): the canonical is the clean view, the patch re-adds
conditioning. Toggle the chunk's patches off (its page becomes the bare relocated canonical,
every other page as is), decode the query, and compare with the answer as the window stands.
Optionally also decode with the chunk dropped (later chunks shift back, keeping their KV).
Costs a few short decodes, never a re-prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from ..core.metrics import kl_divergence
from ..core.operator import relocate
from . import decode
from .receipt import Receipt
from .ref import ChunkRef

if TYPE_CHECKING:  # pragma: no cover
    from ..core.chunk import Chunk
    from .context import WindowContext
    from .slot import Slot


@dataclass
class Verdict:
    """Outcome of ``ContextWindow.is_disposable``.

    ``disposable``: every tested variant gives the same greedy answer as the window as is (and,
    with ``kl_tol``, a first-token KL at most ``kl_tol``). ``kl_unconditioned`` /
    ``kl_dropped``: KL(as is || variant) of the first answer token's distribution (nats).
    Answers are token ids; ``*_text`` the decoded strings when the backend has a tokenizer.
    """

    ref: ChunkRef
    disposable: bool
    answer_as_is: list[int]
    answer_unconditioned: list[int]
    kl_unconditioned: float
    answer_dropped: list[int] | None = None
    kl_dropped: float | None = None
    text_as_is: str | None = None
    text_unconditioned: str | None = None
    text_dropped: str | None = None
    had_conditioning: bool = True
    receipt: Receipt | None = field(default=None, repr=False)

    def __bool__(self) -> bool:
        return self.disposable


def run_test(
    ctx: "WindowContext",
    slots: Sequence["Slot"],
    index: int,
    query_ids: Sequence[int],
    *,
    max_new_tokens: int,
    drop: bool,
    kl_tol: float | None,
    canonical: "Chunk | None" = None,
) -> dict:
    """Decode the three variants; returns the Verdict's fields (without ref and receipt).

    ``canonical``: the slot's canonical when the slot is provisional (latency-first new content:
    its KV is conditioned by its own forward, it carries no patch to toggle off)."""
    eos = decode.eos_ids(ctx)
    start = decode.next_position(ctx, slots)
    base_layers = decode.assemble(ctx, slots)
    p_logits, ans = decode.greedy(ctx, base_layers, start, query_ids, max_new_tokens, eos)

    slot = slots[index]
    conditioned = bool(slot.stack) or canonical is not None
    blind = canonical if canonical is not None else slot.chunk
    bare = tuple(relocate(blind, slot.start, layout=ctx.layout, beyond_trained=True)) if conditioned else slot.page
    off_layers = decode.assemble(ctx, slots, {index: bare})
    q_logits, ans_off = decode.greedy(ctx, off_layers, start, query_ids, max_new_tokens, eos)
    fields: dict = {
        "answer_as_is": ans,
        "answer_unconditioned": ans_off,
        "kl_unconditioned": kl_divergence(p_logits, q_logits),
        "had_conditioning": conditioned,
        "text_as_is": decode.decode_text(ctx, ans),
        "text_unconditioned": decode.decode_text(ctx, ans_off),
    }
    same = ans_off == ans and (kl_tol is None or fields["kl_unconditioned"] <= kl_tol)
    if drop:
        # Later chunks shift back by the dropped span and keep their conditioned KV (survivors),
        # except one left at the front, which gets what the policy gives it on eviction (the
        # canonical, when the policy clears it: exact there).
        pages: dict[int, object] = {index: None}
        shift = slot.span
        for j in range(index + 1, len(slots)):
            s = slots[j]
            patch = list(s.patches) or None
            if j == 1 and patch and ctx.policy.decide("survivor", s, (), valid=not s.conditioned_on, rank=ctx.rank).action == "clear":
                patch = None
            pages[j] = tuple(relocate(s.chunk, s.start - shift, layout=ctx.layout, patch=patch, beyond_trained=True))
        drop_layers = decode.assemble(ctx, slots, pages)  # type: ignore[arg-type]
        d_logits, ans_drop = decode.greedy(ctx, drop_layers, start - shift, query_ids, max_new_tokens, eos)
        fields["answer_dropped"] = ans_drop
        fields["kl_dropped"] = kl_divergence(p_logits, d_logits)
        fields["text_dropped"] = decode.decode_text(ctx, ans_drop)
        same = same and ans_drop == ans and (kl_tol is None or fields["kl_dropped"] <= kl_tol)
    fields["disposable"] = bool(same)
    return fields
