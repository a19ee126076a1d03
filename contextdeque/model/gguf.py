"""GGUF checkpoints through transformers' GGUF loader, dequantized into an ordinary dense model."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from ..core.errors import ModelLoadError


def load_gguf(gguf_path: Path, dtype: torch.dtype, attn_implementation: str) -> tuple[Any, Any]:
    """Load (and dequantize) a GGUF with transformers. The slow step the cache exists to skip."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    try:
        from transformers import GgufConfig

        # 5.18+ may keep supported archs packed in GGUF blocks; we want plain dense weights.
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older 5.x: the legacy loader always dequantizes
        pass
    d, name = str(gguf_path.parent), gguf_path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(
            d, gguf_file=name, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True, **kwargs
        )
        tok = AutoTokenizer.from_pretrained(d, gguf_file=name, local_files_only=True)
    except Exception as e:  # transformers raises ValueError/OSError/RuntimeError/ImportError here
        raise ModelLoadError(f"transformers could not load the GGUF file {gguf_path}: {type(e).__name__}: {e}") from e
    strip_gguf_quantizer(model)
    return model, tok


def strip_gguf_quantizer(model: Any) -> None:
    """Make a GGUF-loaded model an ordinary dense one (save_pretrained refuses otherwise in 5.18)."""
    packed = [n for n, p in model.named_parameters() if not p.is_floating_point()]
    if packed:
        raise ModelLoadError(f"GGUF weights were left packed ({packed[:3]}...); cannot make a dense copy")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False
