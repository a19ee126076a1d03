"""The window root: the fixed header (BOS / chat header / system prompt) every window starts with.

Canonicals are encoded after the root, so a window with its own root needs a backend whose
``root_ids`` are that root. ``backend_with_root`` returns a view of the backend (same model,
tokenizer, layout and fingerprint) with another root; chunk ids differ between roots (the root
digest is part of the content address), so canonicals of different roots never mix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence


if TYPE_CHECKING:  # pragma: no cover
    from ..model.hf import HFBackend


def backend_with_root(backend: "HFBackend", root: str | Sequence[int] | None) -> "HFBackend":
    """``backend`` itself when ``root`` is None or equal to its root, else a view with ``root``
    (text is tokenized without special tokens; give ids to control BOS)."""
    if root is None:
        return backend
    ids = backend.tokenize(root) if isinstance(root, str) else root
    return backend.with_root(ids)
