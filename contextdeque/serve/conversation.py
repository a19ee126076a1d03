"""How serve reads a request's messages: one `MessageWindow` per conversation (the session
layer's chat-messages adapter), plus what serve needs around it — the prompt size a plain server
would prefill (for the budget check and the prefill-avoided metric) and content digests to find
the session a request continues.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

from ..session import ChatMessage, ChatTemplate, TemplateCut, normalize_messages
from ..core.errors import AgentInputError, BudgetError

__all__ = ["Prompt", "check_budget", "image_tokens", "parse_prompt", "prefix_digests", "turns_digest"]


@dataclass(frozen=True)
class Prompt:
    """A request's messages: as sent (what `MessageWindow.sync` takes), normalized, and cut along
    the chat template."""

    raw: tuple[Any, ...]
    messages: tuple[ChatMessage, ...]
    cut: TemplateCut
    image_tokens: int = 0  # tokens the images' vision-tower chunks take

    @property
    def has_images(self) -> bool:
        return any(m.images for m in self.messages)

    @property
    def prompt_tokens(self) -> int:
        """Root + every message (images at their vision-tower size) + the generation prompt:
        what a plain server prefills."""
        body = sum(len(pc) for run in self.cut.pieces for pc in run if not isinstance(pc, int))
        return len(self.cut.root_ids) + body + self.image_tokens + len(self.cut.generation_ids)

    def ids(self) -> list[int]:
        """The whole prompt's token ids (text only)."""
        if self.has_images:
            raise AgentInputError("the prompt holds images: it is not token ids alone")
        out = list(self.cut.root_ids)
        for run in self.cut.pieces:
            for pc in run:
                assert not isinstance(pc, int)
                out.extend(pc)
        return out + list(self.cut.generation_ids)


def parse_prompt(template: ChatTemplate, raw: Sequence[Any], processor: Any = None) -> Prompt:
    """Validate and cut a request's messages.

    ``processor``: a Qwen-VL model's image processor; image parts are taken (sized by the grid
    it would give them) only with one.

    Raises:
        AgentInputError: malformed messages, a template that cannot be cut, an unreadable image
            (``MediaError``), or image parts without a processor (this server runs a text-only
            model; the image-span emulation has no visual understanding, so serving it would
            be a silent lie).
    """
    msgs = normalize_messages(list(raw))
    images = [px for m in msgs for px in m.images]
    if images and processor is None:
        raise AgentInputError("image parts need a vision model; this server serves a text-only model")
    return Prompt(tuple(raw), tuple(msgs), template.cut(msgs), sum(image_tokens(processor, px) for px in images))


def image_tokens(processor: Any, pixels: Any) -> int:
    """Tokens a Qwen-VL vision tower gives ``pixels`` (its merged grid: t·h·w / merge²)."""
    grid = processor(images=[pixels], return_tensors="pt")["image_grid_thw"][0]
    merge = int(getattr(processor, "merge_size", 2))
    return int(grid.prod()) // (merge * merge)


def check_budget(prompt: Prompt, max_new_tokens: int, context_tokens: int | None) -> None:
    """Refuse a request whose prompt plus ``max_new_tokens`` exceeds the served context.

    Raises:
        BudgetError: it does not fit (nothing has been done yet).
    """
    need = prompt.prompt_tokens + max_new_tokens
    if context_tokens is not None and need > context_tokens:
        raise BudgetError(
            f"this conversation needs {prompt.prompt_tokens} prompt tokens + {max_new_tokens} new tokens = "
            f"{need}, beyond the served context of {context_tokens} tokens"
        )


def _feed(h: Any, key: str) -> None:
    b = key.encode()
    h.update(len(b).to_bytes(8, "little") + b)


def turns_digest(keys: Sequence[str]) -> str:
    """Digest of a message list by its messages' content keys (`ChatMessage.key`)."""
    h = hashlib.sha256(b"cdq-turns-v2\0")
    for k in keys:
        _feed(h, k)
    return h.hexdigest()


def prefix_digests(keys: Sequence[str]) -> list[str]:
    """``turns_digest(keys[:n])`` for n = 1..len(keys), in one pass."""
    h = hashlib.sha256(b"cdq-turns-v2\0")
    out = []
    for k in keys:
        _feed(h, k)
        out.append(h.copy().hexdigest())
    return out
