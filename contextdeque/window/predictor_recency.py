"""The ``recency`` recall predictor: the agent's hints first (latest first), then the evicted
chunks, most recently evicted first, each back at the end and as a look-back in front. It learns
nothing; the probabilities only order it (a hint 1, the i-th most recent eviction 1 / (2 + i))."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from .predictor import Prediction, RecallPredictor, hinted, priced, recent_evicted
from .ref import ChunkRef

if TYPE_CHECKING:  # pragma: no cover
    from .state import WindowState


class RecencyPredictor(RecallPredictor):
    name = "recency"

    def predict(self, state: "WindowState", expected: Mapping[ChunkRef, int | None]) -> list[Prediction]:
        out = [priced(state, chain, 1.0, "expected") for chain in reversed(hinted(state, expected))]
        for i, ref in enumerate(recent_evicted(state)):
            p = 1.0 / (2 + i)
            out += [priced(state, [(ref, None)], p, "recency"), priced(state, [(ref, 0)], p * 0.99, "recency")]
        return out
