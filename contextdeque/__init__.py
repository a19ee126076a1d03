"""contextdeque: an agent's context window as a deque of position-free KV-cache chunks.

Public API (stable names)::

    import contextdeque as cd
    backend = cd.load_model()                  # embedded default model, a path, or a PreTrainedModel
    chunk = backend.encode("some text")        # canonical KV(B|root) in the content frame -> cd.Chunk
    kv = cd.relocate(chunk, start)             # exact placement at any position, zero forwards
"""

from __future__ import annotations

from .core.chunk import Chunk
from .core.errors import *  # noqa: F401,F403  (typed errors are public)
from .core.layout import KVLayout
from .core.operator import apply, relocate
from .model import HFBackend, load_model
from .model.detect import detect_layout
from .patch import Patch, SharedBasis, form_patch
from .window import ChunkRef, ContextWindow, Receipt
from . import scheduler as _scheduler  # noqa: F401,E402  (registers placement="scheduler" for ContextWindow)

__version__ = "0.1.0"

__all__ = ["load_model", "HFBackend", "Chunk", "KVLayout", "detect_layout", "relocate", "apply", "form_patch", "Patch", "SharedBasis", "ContextWindow", "ChunkRef", "Receipt"]
