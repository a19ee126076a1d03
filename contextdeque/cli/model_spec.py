"""The one way every command names a model (``--model``): nothing for the embedded default
(SmolLM2-135M-Instruct), a local Hugging Face directory or ``.gguf`` file, or ``tiny:<arch>`` for
a tiny random-weight model of a supported architecture (``contextdeque.model.testing``)."""

from __future__ import annotations

from typing import Any

MODEL_HELP = ("a local HF model dir or .gguf file, or tiny:<arch> for a tiny random-weight model "
              "(default: the embedded SmolLM2-135M-Instruct)")


def load_backend(spec: str | None, *, chat: bool = False) -> Any:
    """The ``HFBackend`` named by ``spec`` (see the module docstring).

    ``chat=True`` (commands that take chat messages, e.g. ``serve``): a tiny model gets the
    default model's tokenizer and chat template (its vocabulary sized to match), so it can be
    served; its replies are noise."""
    from ..model import load_model

    if spec and spec.startswith("tiny:"):
        from ..model.hf import HFBackend
        from ..model.testing import build_tiny_model

        arch = spec.split(":", 1)[1] or "llama"
        if not chat:
            return HFBackend(build_tiny_model(arch, seed=0), None, root_ids=[1, 2, 3], name=f"tiny-{arch}")
        from transformers import AutoTokenizer

        from ..model.default_model import ensure_default_model

        tok = AutoTokenizer.from_pretrained(ensure_default_model(progress=False))
        sizes = {"vocab_size": len(tok), "max_position_embeddings": 2048}
        vl = arch in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # their text sizes live in text_config
        model = build_tiny_model(arch, seed=0, **({"text_config": sizes} if vl else sizes))
        return HFBackend(model, tok, name=f"tiny-{arch}")
    return load_model(spec)


def image_processor(backend: Any, model: str | None) -> Any:
    """A Qwen-VL model's image processor: the tiny one for ``tiny:<arch>``, else the one saved
    beside a local checkpoint; ``None`` for a text-only model."""
    arch = getattr(backend.model.config, "model_type", "")
    if arch not in ("qwen2_vl", "qwen2_5_vl"):
        return None
    if model and model.startswith("tiny:"):
        from ..model.testing import build_tiny_vl_processor

        return build_tiny_vl_processor(arch)
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model)
