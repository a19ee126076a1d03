"""The one way every command names a model (``--model``): nothing for the embedded default
(SmolLM2-135M-Instruct), a local Hugging Face directory or ``.gguf`` file, or ``tiny:<arch>`` for
a tiny random-weight model of a supported architecture (``contextdeque.model.testing``); and its
torch threads (``--threads``, :func:`add_threads_argument`)."""

from __future__ import annotations

import argparse
from typing import Any

MODEL_HELP = ("a local HF model dir or .gguf file, or tiny:<arch> (tiny: a tiny llama with a long context) "
              "for a tiny random-weight model (default: the embedded SmolLM2-135M-Instruct)")


THREADS_HELP = ("torch CPU threads: a count, 0 for torch's own default, or auto (the default: from the cores "
                "this process may use, the machine's load and the model's size; $CONTEXTDEQUE_THREADS "
                "overrides it)")


def thread_count(text: str) -> int | None:
    """``--threads``'s value: None for auto, 0 for torch's own, else a count (argparse reports a
    ``ValueError`` as an invalid value)."""
    from ..model.threads import parse_threads

    return parse_threads(text, "--threads")


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """Every command's ``--threads`` (see ``contextdeque.model.threads``)."""
    parser.add_argument("--threads", type=thread_count, default=None, metavar="N", help=THREADS_HELP)


def apply_threads_argument(args: argparse.Namespace, model_params: int | None = None) -> Any:
    """Set torch's threads from ``--threads`` for a command that loads no model through
    :func:`load_backend`; returns the ``ThreadChoice``."""
    from ..model.threads import apply_threads

    return apply_threads(getattr(args, "threads", None), model_params=model_params)


def load_backend(spec: str | None, *, chat: bool = False, verify_at_load: bool = True, device: str = "cpu",
                 threads: int | str | None = None) -> Any:
    """The ``HFBackend`` named by ``spec`` (see the module docstring; ``tiny``: a tiny llama), its
    model on ``device`` (e.g. ``"cuda"``).

    ``chat=True`` (commands that take chat messages, e.g. ``serve``): a tiny model gets the
    default model's tokenizer and chat template (its vocabulary sized to match), so it can be
    served; its replies are noise. ``verify_at_load=False`` skips the load-time layout proof
    (``verify-model`` runs the full gate itself). ``threads``: the command's ``--threads``
    (``load_model``'s choice when None)."""
    from ..model import load_model
    from ..model.threads import apply_threads, parameter_count

    if device != "cpu":
        from ..model.hf import HFBackend

        # loaded on the CPU (unproven), moved, then wrapped again: the layout proof runs on the
        # device the chunks will be placed on (its verdict is cached per device type)
        cpu = load_backend(spec, chat=chat, verify_at_load=False, threads=threads)
        return HFBackend(
            cpu.model.to(device), cpu.tokenizer, root_ids=cpu.root_ids, name=cpu.name, fingerprint=cpu.fingerprint,
            verify_at_load=verify_at_load,
        )
    if spec == "tiny" or (spec and spec.startswith("tiny:")):
        from ..model.testing import tiny_backend

        arch = spec.partition(":")[2]
        # a bare ``tiny`` is the tiny llama with an 8192-position trained context, long enough for
        # the benchmarks' default windows (``tiny:llama`` keeps the tiny models' 512)
        sizes = {} if arch else {"max_position_embeddings": 8192}
        arch = arch or "llama"
        if not chat:
            backend = tiny_backend(arch, verify_at_load=verify_at_load, **sizes)
        else:
            from transformers import AutoTokenizer

            from ..model.default_model import ensure_default_model

            tok = AutoTokenizer.from_pretrained(ensure_default_model(progress=False))
            backend = tiny_backend(arch, tokenizer=tok, verify_at_load=verify_at_load)
        apply_threads(threads, model_params=parameter_count(backend.model))
        return backend
    return load_model(spec, verify_at_load=verify_at_load, threads=threads)


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
