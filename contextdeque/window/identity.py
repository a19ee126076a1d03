"""Chunk ids computed from a chunk's inputs, without running the model.

The window looks a chunk up in the store *before* encoding it, so content seen once is never
encoded again. The id must be exactly the one ``HFBackend.encode`` gives (content address of
model, root, inputs and storage dtype); ``tests/test_window.py`` checks the two agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from ..chunk import chunk_id, digest, storage_dtype
from ..errors import EmptyChunkError

if TYPE_CHECKING:  # pragma: no cover
    from ..backends.hf import HFBackend


def chunk_id_for(
    backend: "HFBackend",
    *,
    token_ids: Sequence[int] | torch.Tensor | None = None,
    embeds: torch.Tensor | None = None,
    rel_positions: torch.Tensor | None = None,
    span: int | None = None,
    storage: torch.dtype | str = torch.float32,
) -> str:
    """The id ``backend.encode(token_ids=... | embeds=..., rel_positions=, span=, storage=)`` would
    give (``token_ids [T]`` or ``embeds [T, hidden]``; ``rel_positions [n_axes, T]``)."""
    if (token_ids is None) == (embeds is None):
        raise EmptyChunkError("give exactly one of token_ids or embeds")
    dt = storage_dtype(storage)
    ids_t = None if token_ids is None else torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    n = int(ids_t.numel()) if ids_t is not None else int(embeds.shape[0])
    if n == 0:
        raise EmptyChunkError("cannot encode an empty chunk")
    if rel_positions is None:
        rel = torch.arange(n, dtype=torch.long).unsqueeze(0).expand(backend.n_pos_axes, -1).clone()
    else:
        rel = torch.as_tensor(rel_positions, dtype=torch.long)
        if rel.dim() == 1:
            rel = rel.unsqueeze(0).expand(backend.n_pos_axes, -1).clone()
    span = int(span) if span is not None else int(rel.max()) + 1
    input_digest = digest(ids_t if ids_t is not None else embeds.to(torch.float32), rel, span)[:32]
    return chunk_id(backend.fingerprint, backend.root_digest, input_digest, dt)
