"""Text on a backend: token ids with or without a tokenizer, the suffix that closes a user turn,
and real English to measure with (CPython's documentation, ``pydoc_data``: the benches' one text
source).

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


def text_chunks(backend: Any, n: int, size: int, text: str | None = None) -> list[list[int]]:
    """``n`` chunks of ``size`` token ids of real documentation text (ids folded into the
    vocabulary for a tokenizer-less model); ``text``: another text than the topics in order."""
    from pydoc_data.topics import topics

    if text is None:
        text = "\n\n".join(topics[k] for k in sorted(topics))
    if backend.tokenizer is not None:
        ids = backend.tokenize(text[: 12 * n * size])
    else:
        vocab = int(backend.model.config.vocab_size)
        ids = [3 + b % (vocab - 3) for b in text.encode()]
    if len(ids) < n * size:
        raise SystemExit(f"not enough text for {n} x {size} tokens")
    return [ids[i * size : (i + 1) * size] for i in range(n)]


def text_ids(backend: Any, n: int) -> torch.Tensor:
    """``[n]`` ids of real text (the first of :func:`text_chunks`)."""
    return torch.tensor(text_chunks(backend, 1, n)[0], dtype=torch.long)
