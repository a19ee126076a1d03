"""Numerical comparisons every layer may use: next-token KL between two logit vectors, and
errors in units in the last place (ULP) of a storage dtype, and quantiles of measured values."""

from __future__ import annotations

import math
from typing import Sequence

import torch


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(P ‖ Q) in nats between the softmaxes of ``p_logits`` and ``q_logits`` (``[vocab]``), fp64.

    P is the reference (re-prefill), Q the arm. Zero iff the distributions are equal.
    """
    return max(0.0, float(kl_divergence_tensor(p_logits, q_logits)))


def kl_divergence_tensor(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """:func:`kl_divergence` as a 0-d fp64 tensor that carries gradients (not clamped at 0)."""
    lp = torch.log_softmax(p_logits.to(torch.float64).reshape(-1), dim=-1)
    lq = torch.log_softmax(q_logits.to(torch.float64).reshape(-1), dim=-1)
    if lp.shape != lq.shape:
        raise ValueError(f"logit shapes differ: {tuple(lp.shape)} vs {tuple(lq.shape)}")
    return (lp.exp() * (lp - lq)).sum()


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


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-quantile (``q`` in [0, 1]) of ``values``, linearly interpolated between order
    statistics (numpy's default); None for no values. ``percentile(x, 0.1)``: the 10th percentile."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    pos = (len(xs) - 1) * float(q)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
