"""contextdeque: an agent's context window as a deque of position-free KV-cache chunks.

Public API (stable names)::

    import contextdeque as cd
    backend = cd.load_model()                  # embedded default model, a path, or a PreTrainedModel
    chunk = backend.encode("some text")        # canonical KV(B|root) in the content frame -> cd.Chunk
    kv = cd.relocate(chunk, start)             # exact placement at any position, zero forwards

The public names are imported when first used (``__getattr__`` below), so ``import contextdeque``
costs no more than the standard library and transformers is loaded only with a model. The typed
errors are plain Python and imported at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .core.errors import *  # noqa: F401,F403  (typed errors are public)

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC: dict[str, str] = {
    "load_model": ".model", "HFBackend": ".model", "Chunk": ".core.chunk", "KVLayout": ".core.layout",
    "detect_layout": ".model.detect", "relocate": ".core.operator", "apply": ".core.operator",
    "form_patch": ".patch", "Patch": ".patch", "SharedBasis": ".patch", "ContextWindow": ".window",
    "ChunkRef": ".window", "Receipt": ".window", "RelocatedKV": ".core.kv", "choose_threads": ".model.threads",
    "ThreadChoice": ".model.threads",
}

__all__ = list(_PUBLIC)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports on first use
    from .core.chunk import Chunk
    from .core.kv import RelocatedKV
    from .core.layout import KVLayout
    from .core.operator import apply, relocate
    from .model import HFBackend, load_model
    from .model.detect import detect_layout
    from .model.threads import ThreadChoice, choose_threads
    from .patch import Patch, SharedBasis, form_patch
    from .window import ChunkRef, ContextWindow, Receipt


def __getattr__(name: str) -> Any:
    module_name = _PUBLIC.get(name)
    if module_name is None:
        raise AttributeError(f"module 'contextdeque' has no attribute {name!r}")
    module = importlib.import_module(module_name, __name__)
    value = getattr(module, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
