"""The model layer: a transformers model behind one backend (``hf``), how it is loaded
(``load``), the embedded default model's fetch and cache (``default_model``), GGUF loading
(``gguf``), vision towers (``vision``), the chat template (``chat``) and tiny random-weight
models for tests (``testing``)."""

from __future__ import annotations

from .hf import ForwardResult, HFBackend, model_fingerprint
from .load import load_model

__all__ = ["HFBackend", "ForwardResult", "load_model", "model_fingerprint"]
