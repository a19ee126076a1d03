"""Fidelity metrics (DESIGN §8), the definitions used everywhere.

- next-token KL(re-prefill ‖ arm) on the query's logits, in nats, fp64
  (``contextdeque.core.metrics.kl_divergence``).
- ``eta``: (KL_blind − KL_arm) / KL_blind, the fraction of blind reuse's gap an arm closes; None
  where blind reuse leaves no measurable gap (η is a ratio to that gap, so it is only defined
  where there is one — the paper aggregates over items "with a measurable deficit").
- ``flip_recover``: among items where blind reuse changes the greedy answer, the share where the
  arm gives the re-prefill answer back; None when no item flips.
- KV error in ULPs of the storage dtype, elementwise and at the tensor's scale
  (``contextdeque.core.metrics.ulp_error`` / ``ulp_error_at_scale``).
- ``bytes_report``: canonical bytes, patch bytes, their ratio.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from ...core.metrics import percentile  # noqa: F401  (its home is core: the model layer reads it too)

# Items whose blind-reuse KL is below this carry no measurable gap: η (a ratio to that gap) would
# be noise there. Fixed a priori (1e-4 nats, ~4 orders above fp32 re-prefill noise), not tuned.
DEFAULT_MIN_GAP = 1e-4


def eta(kl_blind: float, kl_arm: float, min_gap: float = 0.0) -> float | None:
    """``(KL_blind − KL_arm) / KL_blind``; None when ``KL_blind <= min_gap`` (no gap to close).

    1 = the arm closes blind reuse's whole gap, 0 = no better than blind, < 0 = worse than blind.
    """
    if not kl_blind > max(min_gap, 0.0):
        return None
    return (kl_blind - kl_arm) / kl_blind


def pooled_eta(kl_blind: Sequence[float], kl_arm: Sequence[float]) -> float | None:
    """``1 − Σ KL_arm / Σ KL_blind`` over items: the gap closed in aggregate (robust to tiny gaps)."""
    total = float(sum(kl_blind))
    if total <= 0:
        return None
    return 1.0 - float(sum(kl_arm)) / total


def flip_recover(ref: Sequence[object], blind: Sequence[object], arm: Sequence[object]) -> float | None:
    """Share of items where ``blind[i] != ref[i]`` (blind reuse flips the answer) and ``arm[i] == ref[i]``.

    None when no item flips (the metric is undefined, not 0 or 1).
    """
    if not (len(ref) == len(blind) == len(arm)):
        raise ValueError("flip_recover needs equal-length answer lists")
    flipped = [i for i in range(len(ref)) if blind[i] != ref[i]]
    if not flipped:
        return None
    return sum(1 for i in flipped if arm[i] == ref[i]) / len(flipped)


def n_flips(ref: Sequence[object], blind: Sequence[object]) -> int:
    return sum(1 for r, b in zip(ref, blind) if r != b)


@dataclass(frozen=True)
class BytesReport:
    """Stored bytes: ``canonical`` page(s), ``patch`` factors, and ``ratio`` = patch / canonical."""

    canonical: int
    patch: int

    @property
    def ratio(self) -> float:
        return self.patch / self.canonical if self.canonical else math.inf if self.patch else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"canonical": self.canonical, "patch": self.patch, "ratio": self.ratio}


def bytes_report(chunks: Sequence[object], patches: Sequence[object] = ()) -> BytesReport:
    """Bytes of the chunks' canonical pages and of the patches (anything with ``nbytes``)."""
    return BytesReport(canonical=int(sum(c.nbytes for c in chunks)), patch=int(sum(p.nbytes for p in patches)))


def summarize(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """Median and mean over the defined values (Nones dropped) and how many there were."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not vals:
        return {"median": None, "mean": None, "n": 0}
    return {"median": statistics.median(vals), "mean": statistics.fmean(vals), "n": len(vals)}


