"""The chat template, read once for everyone: what precedes a user message's content (the window
root's header) and what follows it (the end of the user turn and the assistant header).

Both come from rendering the tokenizer's template around a marker that no message contains and
splitting the text at it, so any template (ChatML, Llama, Gemma, ...) is read the same way.
"""

from __future__ import annotations

from typing import Any

_MARKER = "\x00CTXDQ\x00"


def has_template(tokenizer: Any) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def _around_user_content(tokenizer: Any, system: str, generation_prompt: bool) -> tuple[str, str]:
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": _MARKER}],
        tokenize=False,
        add_generation_prompt=generation_prompt,
    )
    head, _, tail = text.partition(_MARKER)
    return head, tail


def user_header(tokenizer: Any, system: str) -> str:
    """The template's text up to the user turn's content: BOS, the ``system`` prompt, the user
    header (the root every window starts with)."""
    return _around_user_content(tokenizer, system, False)[0]


def user_turn_suffix(tokenizer: Any) -> str:
    """What closes a user turn and opens the assistant's (``"<|im_end|>\\n<|im_start|>assistant\\n"``
    for ChatML); ``"\\n"`` for a tokenizer without a template."""
    if not has_template(tokenizer):
        return "\n"
    return _around_user_content(tokenizer, "s", True)[1]
