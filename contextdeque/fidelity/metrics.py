"""Fidelity metrics (DESIGN §8), the definitions used everywhere.

- ``kl_divergence``: next-token KL(re-prefill ‖ arm) on the query's logits, in nats, fp64.
- ``eta``: (KL_blind − KL_arm) / KL_blind, the fraction of blind reuse's gap an arm closes; None
  where blind reuse leaves no measurable gap (η is a ratio to that gap, so it is only defined
  where there is one — the paper aggregates over items "with a measurable deficit").
- ``flip_recover``: among items where blind reuse changes the greedy answer, the share where the
  arm gives the re-prefill answer back; None when no item flips.
- ``ulp_error``: |x − ref| in units of ref's ULP in the storage dtype (elementwise), and
  ``ulp_error_at_scale``: max |x − ref| in ULPs at the tensor's scale (max |ref|).
- ``bytes_report``: canonical bytes, patch bytes, their ratio.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

import torch

# Items whose blind-reuse KL is below this carry no measurable gap: η (a ratio to that gap) would
# be noise there. Fixed a priori (1e-4 nats, ~4 orders above fp32 re-prefill noise), not tuned.
DEFAULT_MIN_GAP = 1e-4


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(P ‖ Q) in nats between the softmaxes of ``p_logits`` and ``q_logits`` (``[vocab]``), fp64.

    P is the reference (re-prefill), Q the arm. Zero iff the distributions are equal.
    """
    lp = torch.log_softmax(p_logits.to(torch.float64).reshape(-1), dim=-1)
    lq = torch.log_softmax(q_logits.to(torch.float64).reshape(-1), dim=-1)
    if lp.shape != lq.shape:
        raise ValueError(f"logit shapes differ: {tuple(lp.shape)} vs {tuple(lq.shape)}")
    return max(0.0, float((lp.exp() * (lp - lq)).sum()))


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


_MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}
_MIN_EXP = {torch.float32: -126, torch.bfloat16: -126, torch.float16: -14, torch.float64: -1022}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The unit in the last place of ``dtype`` at each value of ``x`` (fp64 result).

    ``ulp(v) = 2^(e - p)`` for ``2^e <= |v| < 2^(e+1)`` with ``p`` mantissa bits; subnormals and zero
    take the smallest subnormal spacing ``2^(e_min - p)``.
    """
    if dtype not in _MANTISSA_BITS:
        raise ValueError(f"no ULP definition for {dtype}")
    p, emin = _MANTISSA_BITS[dtype], _MIN_EXP[dtype]
    a = x.detach().to(torch.float64).abs()
    _, e = torch.frexp(a)  # a = m * 2^e with 0.5 <= m < 1, so floor(log2 a) = e - 1
    e = torch.where(a > 0, e.to(torch.float64) - 1, torch.full_like(a, float(emin)))
    e = torch.clamp(e, min=emin)
    return torch.pow(torch.tensor(2.0, dtype=torch.float64), e - p)


def ulp_error(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``|x − ref| / ulp(ref)`` elementwise, in ULPs of ``dtype`` (fp64 result)."""
    if x.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(x.shape)} vs {tuple(ref.shape)}")
    d = (x.detach().to(torch.float64) - ref.detach().to(torch.float64)).abs()
    return d / ulp(ref, dtype)


def ulp_error_at_scale(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """``max |x − ref|`` in ULPs of ``dtype`` at the tensor's scale (the spacing at ``max |ref|``):
    the convention ``verify-model`` uses, meaningful where ``ref`` has exact zeros."""
    if x.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(x.shape)} vs {tuple(ref.shape)}")
    if x.numel() == 0:
        return 0.0
    d = float((x.detach().to(torch.float64) - ref.detach().to(torch.float64)).abs().max())
    scale = ref.detach().to(torch.float64).abs().max().reshape(1)
    return d / float(ulp(scale, dtype)[0])


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
