"""Text on a backend: token ids with or without a tokenizer, the suffix that closes a user turn,
and real English to measure with.

Tiny random test models have no tokenizer: their text goes through a byte mapping into the
vocabulary, so every caller (the probe set, ``verify``, the agents, benches) tokenizes the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from .chat import user_turn_suffix


def _fallback_ids(text: str, vocab: int) -> list[int]:
    """A tokenizer-less byte mapping (tiny random test models): byte b -> 4 + b mod (vocab - 4)."""
    return [4 + (b % max(1, vocab - 4)) for b in text.encode("utf-8")]


def tokenize(backend: Any, text: str) -> list[int]:
    """``text``'s token ids on ``backend`` (its tokenizer, or the byte mapping without one)."""
    if backend.tokenizer is None:
        return _fallback_ids(text, int(backend.model.get_input_embeddings().weight.shape[0]))
    return backend.tokenize(text)


def query_suffix(backend: Any) -> str:
    """What closes the user turn and opens the assistant turn in the backend's chat template
    (``"<|im_end|>\\n<|im_start|>assistant\\n"`` for ChatML); a newline without a template."""
    return user_turn_suffix(backend.tokenizer)


def pydoc_text_ids(backend: Any, n: int) -> torch.Tensor:
    """``[n]`` token ids of real English: CPython's reference-manual topics (``pydoc_data``, shipped
    with Python) in name order, tokenized by the backend's tokenizer."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for key in sorted(topics):
        ids += backend.tokenize(topics[key])
        if len(ids) >= n:
            break
    return torch.tensor(ids[:n], dtype=torch.long)
