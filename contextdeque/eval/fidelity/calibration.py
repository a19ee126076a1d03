"""Calibration chunks for compressed-at-rest (KVCapsule) bases, disjoint from the probe set.

- text: 16 reference-manual topics of CPython's ``pydoc_data.topics`` that no probe item uses
  (and that do not embed a probe topic's text), each encoded once (up to 512 tokens, the longest
  probe chunk, topics shorter than that are skipped); chunks of length ``T`` are fitted on their
  first ``T`` rows — exactly the canonicals of their first ``T`` tokens (a row's KV depends only
  on the root and the tokens before it), whose Gram statistics are the top-left blocks;
- image spans: 7 scikit-image pictures no probe item shows (``horse``, ``logo``, ``checkerboard``,
  ``cell``, ``microaneurysms``, ``retina``, ``shepp_logan_phantom``) through the probe set's same
  emulated projection, on the grid of the span being compressed.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.capsule import CalibrationStats
from ...core.chunk import Chunk
from ...core.errors import CapsuleError
from ...model.images import embedding_norm, image_span_embeddings
from ...model.text import tokenize
from .probes import MAX_CHUNK_TOKENS

CALIBRATION_TOPICS = (
    "assignment", "async", "attribute-access", "customization", "debugger", "formatstrings", "identifiers", "import",
    "numeric-types", "objects", "operator-summary", "sequence-types", "specialnames", "string-methods",
    "typesmapping", "typesseq-mutable",
)
CALIBRATION_IMAGES = ("horse", "logo", "checkerboard", "cell", "microaneurysms", "retina", "shepp_logan_phantom")


class ProbeCalibration:
    """``calibrate(chunk) -> [Chunk]``: calibration chunks shaped like ``chunk`` (see the module
    docstring), encoded by ``backend`` in ``storage``. Text encodes are made once and reused."""

    def __init__(self, backend: Any, storage: torch.dtype | str = torch.float32, *,
                 max_tokens: int = MAX_CHUNK_TOKENS) -> None:
        self.backend, self.storage, self.max_tokens = backend, storage, int(max_tokens)
        self._text: CalibrationStats | None = None
        self.encodes = 0

    def text_stats(self) -> CalibrationStats:
        """Gram statistics of the calibration topics' first ``max_tokens`` tokens (encoded once)."""
        if self._text is None:
            from pydoc_data.topics import topics

            out = []
            for name in CALIBRATION_TOPICS:
                ids = tokenize(self.backend, topics[name])[: self.max_tokens]
                if len(ids) < self.max_tokens:
                    continue  # too short to serve every chunk length
                out.append(self.backend.encode(token_ids=ids, storage=self.storage, meta={"calibration": name}))
                self.encodes += 1
            self._text = CalibrationStats.from_chunks(out)
        return self._text

    def __call__(self, chunk: Chunk) -> "CalibrationStats | list[Chunk]":
        T = chunk.n_tokens
        if chunk.token_ids is not None:
            return self.text_stats().prefix(T)
        grid = chunk.meta.get("grid")
        if grid is None:
            raise CapsuleError(f"image chunk {chunk.id[:12]} records no grid: cannot render calibration pictures for it")
        rows, cols = (int(x) for x in grid.split("x"))
        hidden = int(self.backend.model.get_input_embeddings().weight.shape[1])
        norm = embedding_norm(self.backend)
        out = []
        for name in CALIBRATION_IMAGES:
            emb = image_span_embeddings(name, (rows, cols), hidden, norm)
            out.append(self.backend.encode(embeds=emb, rel_positions=chunk.rel_positions, span=chunk.span,
                                           storage=self.storage, modality=chunk.modality,
                                           meta={"calibration": name, "grid": grid}))
            self.encodes += 1
        return out
