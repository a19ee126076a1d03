"""VLCache: recompute the first ``r_l · T`` tokens of every reused chunk at layer ``l``, with the
per-layer ratio ``r_l`` non-increasing in depth (a token dropped at one layer is never picked up
again deeper: its hidden state is no longer carried).

The schedule is given, or profiled the VLCache way (:func:`profile_schedule`): per layer and rate
a sensitivity (logit MSE when only that layer recomputes), then a greedy allocation under a mean
budget and the monotone constraint. The default is a linear ramp with mean ``ratio``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ...core.errors import ReuseArmError
from .base import ArmResult, ReuseArm, ReuseRequest
from .recompute import recompute_in_context


def linear_schedule(num_layers: int, ratio: float) -> list[float]:
    """A straight ramp from ``min(1, 2r)`` at layer 0 to ``max(0, 2r - 1)`` at the last layer:
    non-increasing, mean exactly ``r`` (all ones at ``r = 1``)."""
    if not 0.0 <= ratio <= 1.0:
        raise ReuseArmError(f"vlcache ratio must be in [0, 1], got {ratio}")
    hi, lo = min(1.0, 2 * ratio), max(0.0, 2 * ratio - 1.0)
    if num_layers == 1:
        return [ratio]
    return [hi + (lo - hi) * l / (num_layers - 1) for l in range(num_layers)]


def check_schedule(schedule: Sequence[float], num_layers: int | None = None) -> list[float]:
    """Validate a per-layer schedule: values in [0, 1], non-increasing, one per layer."""
    s = [float(x) for x in schedule]
    if num_layers is not None and len(s) != num_layers:
        raise ReuseArmError(f"vlcache schedule has {len(s)} entries for a {num_layers}-layer model")
    if any(not 0.0 <= x <= 1.0 for x in s):
        raise ReuseArmError("vlcache schedule ratios must lie in [0, 1]")
    if any(b > a + 1e-12 for a, b in zip(s, s[1:])):
        raise ReuseArmError("vlcache schedule must be non-increasing with depth")
    return s


def _n_first(ratio: float, n_tokens: int) -> int:
    return min(n_tokens, int(math.ceil(ratio * n_tokens - 1e-9)))


def schedule_masks(request: ReuseRequest, schedule: Sequence[float]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(select [n], keep per layer [n] bool)``: the first ``ceil(r_0 T_i)`` tokens of every chunk
    are re-prefilled; at layer ``l`` only the first ``ceil(r_l T_i)`` keep their recomputed KV."""
    offs = [o - request.root_len for o in request.offsets]
    sel, within, sizes = [], [], []
    for o, c in zip(offs, request.chunks):
        n0 = _n_first(schedule[0], c.n_tokens) if schedule else 0
        sel.append(torch.arange(o, o + n0))
        within.append(torch.arange(n0))
        sizes.append(c.n_tokens)
    select = torch.cat(sel)
    keep = []
    for r in schedule:
        keep.append(torch.cat([w < _n_first(r, T) for w, T in zip(within, sizes)]))
    return select, keep


class VLCacheArm(ReuseArm):
    """Layer-adaptive first-token recompute. ``schedule``: per-layer ratios (non-increasing);
    default :func:`linear_schedule` with mean ``ratio``."""

    name = "vlcache"

    def __init__(self, ratio: float = 0.15, *, schedule: Sequence[float] | None = None, label: str | None = None) -> None:
        if schedule is not None:
            schedule = check_schedule(schedule)
            ratio = sum(schedule) / max(1, len(schedule))
        elif not 0.0 <= float(ratio) <= 1.0:
            raise ReuseArmError(f"vlcache ratio must be in [0, 1], got {ratio}")
        super().__init__(label=label or f"vlcache-{round(100 * ratio)}")
        self.ratio, self.schedule = float(ratio), schedule

    def schedule_for(self, num_layers: int) -> list[float]:
        if self.schedule is None:
            return linear_schedule(num_layers, self.ratio)
        return check_schedule(self.schedule, num_layers)

    def run(self, request: ReuseRequest) -> ArmResult:
        rep = self.new_report(request)
        rep.bytes_canonical = request.page_bytes
        sched = self.schedule_for(request.num_layers)
        select, keep = schedule_masks(request, sched)
        kv, st = recompute_in_context(request, request.blind_kv(), select, keep)
        if st.tokens:
            rep.forwards = 1
        rep.tokens_prefilled = st.tokens
        rep.token_layers = st.token_layers
        rep.tokens_recomputed = st.replaced
        rep.extras["schedule_mean"] = sum(sched) / len(sched)
        return ArmResult(kv=kv, next_position=request.next_position, report=rep)


# ---------------------------------------------------------------------------- profiling


@dataclass
class ProfileSample:
    """One proxy item for profiling: the request, its query token ids (placed right after the
    chunks) and the reference (re-prefill) next-token logits ``[vocab]``."""

    request: ReuseRequest
    query_ids: Sequence[int]
    ref_logits: torch.Tensor


def layer_sensitivity(samples: Sequence[ProfileSample], rates: Sequence[float]) -> torch.Tensor:
    """``S [L, len(rates)]``: mean logit MSE when only layer ``l`` recomputes the first ``rate``
    of every chunk in context (VLCache eq. 5). Costs ``L · len(rates)`` recompute forwards per sample."""
    if not samples:
        raise ReuseArmError("profiling needs at least one sample")
    L = samples[0].request.num_layers
    S = torch.zeros(L, len(rates), dtype=torch.float64)
    for smp in samples:
        req = smp.request
        be = req.backend
        base = req.blind_kv()
        q = torch.as_tensor(list(smp.query_ids), dtype=torch.long)
        qpos = be.text_positions(req.next_position, q.numel())
        ref = smp.ref_logits.to(torch.float64)
        for j, r in enumerate(rates):
            sched = [r] * L
            select, keep_all = schedule_masks(req, sched)
            for l in range(L):
                keep = [keep_all[i] if i == l else torch.zeros_like(keep_all[i]) for i in range(L)]
                kv, _ = recompute_in_context(req, base, select, keep)
                lg = be.forward(input_ids=q, positions=qpos, past=kv).logits[-1].to(torch.float64)
                S[l, j] += float(((lg - ref) ** 2).mean())
    return S / len(samples)


def allocate_schedule(sensitivity: torch.Tensor, rates: Sequence[float], target_ratio: float, base_error: float) -> list[float]:
    """VLCache's greedy allocation: minimize the summed per-layer sensitivity with mean ratio at most
    ``target_ratio`` and ratios non-increasing with depth.

    ``sensitivity [L, len(rates)]`` (from :func:`layer_sensitivity`), ``base_error``: the error with
    nothing recomputed (rate 0). A step raises layers ``0..l`` to at least a grid rate together
    (so a sensitive deep layer is reachable), picking the best error drop per unit of budget.
    """
    L = sensitivity.shape[0]
    grid = [0.0] + [float(r) for r in rates]
    table = torch.cat([torch.full((L, 1), float(base_error), dtype=torch.float64), sensitivity.to(torch.float64)], 1)
    level = [0] * L  # index into grid per layer
    budget = target_ratio * L
    used = 0.0
    while True:
        best = None
        for l in range(L):
            for g in range(level[l] + 1, len(grid)):
                new = [max(level[i], g) if i <= l else level[i] for i in range(L)]
                cost = sum(grid[new[i]] - grid[level[i]] for i in range(L))
                if cost <= 0 or used + cost > budget + 1e-12:
                    continue
                gain = sum(float(table[i, level[i]] - table[i, new[i]]) for i in range(L))
                if gain <= 0:
                    continue
                if best is None or gain / cost > best[0]:
                    best = (gain / cost, new, cost)
        if best is None:
            break
        _, level, cost = best
        used += cost
    return check_schedule([grid[g] for g in level], L)


def profile_schedule(
    samples: Sequence[ProfileSample], target_ratio: float = 0.15, rates: Sequence[float] = (0.05, 0.1, 0.2, 0.3, 0.5)
) -> list[float]:
    """Profile per-layer sensitivity on ``samples`` and allocate a schedule with mean ``<= target_ratio``."""
    base = 0.0
    for smp in samples:
        req = smp.request
        be = req.backend
        q = torch.as_tensor(list(smp.query_ids), dtype=torch.long)
        lg = be.forward(input_ids=q, positions=be.text_positions(req.next_position, q.numel()), past=req.blind_kv()).logits[-1]
        base += float(((lg.to(torch.float64) - smp.ref_logits.to(torch.float64)) ** 2).mean())
    base /= len(samples)
    S = layer_sensitivity(samples, rates)
    return allocate_schedule(S, rates, target_ratio, base)
