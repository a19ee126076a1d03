"""Rank allocation under one byte budget, and the fidelity rule a window's target sets.

A patch's K and V corrections are factorized per layer; each kept direction j of layer l costs
``(T + F) * element_size`` bytes (one column of ``U S`` and one row of ``V^T``) and captures
``s²_{l,j}`` of that layer's Δ energy. A window's rule counts each layer's deficit relative to
the layer's own KV (``w_l = 1 / ‖K_l‖²``, likewise V: a layer's error matters as a fraction of
what that layer holds — the V norms of the default model grow 20x with depth), pools it over
layers (so the layers where the deficit lives weigh the most; the paper's Appendix B/C: the
middle and deep layers; a layer without deficit gets nothing), and weighs K and V equally:

    E = ½ Σ_l w_l^K Σ_{j<m_l^K} s²_K[l,j] / Σ_l w_l^K ‖Δ_K,l‖²  +  ½ (the same for V)

When the model's envelope carries measured per-layer sensitivities (:class:`LayerSensitivity`:
the next-token KL one unit of a layer's relative K or V deficit costs, fitted in calibration —
opt-in), each weight is multiplied by its layer's sensitivity and K and V are pooled in one
fraction:

    E = Σ_{l, K/V} a_l w_l Σ_{j<m_l} s²[l,j] / Σ_{l, K/V} a_l w_l ‖Δ_l‖²

which, were the KL a sum of per-layer terms, would be the fraction of blind reuse's KL the patch
closes. Measured, it is not (on the default model the sensitivities say K outweighs V ≈ 20x; the
allocation then starves V and loses η against equal weights and uniform ranks; Gemma 3 likewise —
docs/fidelity.md), so calibration leaves them out unless asked.

:func:`allocate_ranks` water-fills bytes to where the energy is: directions are taken greedily by
marginal energy per byte. Within a (layer, K/V) the singular values descend and the cost is
constant, so the greedy order takes every layer's directions top-down (an allocation is a set of
per-layer ranks), and each prefix of that order is the fractional knapsack's optimum at its own
byte count, hence the most energy any allocation of at most those bytes captures. So a target is
reached with at most one direction's bytes more than the fewest possible, and under a byte cap B
the allocation captures at least the optimum of B minus one direction's bytes (when K and V
directions cost the same: exactly the fewest bytes, exactly the optimum). Layers with a
negligible deficit get rank 0.

:func:`allocate_precision` allocates bytes, not only rank: each kept direction also gets a storage
precision (:mod:`contextdeque.patch.factors`: the patch's dtype, bf16, int8 or int4), its captured
energy the direction's energy less its measured quantization error — reverse water-filling over
bits, the leading directions kept finely and the tail coarsely (docs/fidelity.md has what it
gains on the default model).

:class:`FidelityRule` turns a window's ``fidelity_target`` (an η, through the model's calibrated
envelope, :mod:`contextdeque.model.envelope`) into an energy, allocates under the byte cap, and
says what a miss does (``on_miss``). What it decided is recorded in ``patch.meta["fidelity"]``
(:func:`fidelity_report`), so a patch served from a store reports as the formed one did.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import PatchError
from .base import Patch
from .factors import PRECISIONS, check_precisions, direction_cost, direction_errors
from .ops import cut_patch, mix_patch

ON_MISS = ("report", "exceed_budget", "recompute")
"""What a patch does when the byte cap cannot meet the target: ``report`` keeps the best patch
within the cap and reports the miss; ``exceed_budget`` takes the bytes the target needs; and
``recompute`` gives the chunk its exact conditioning (every direction: the KV a re-prefill of it
computes), whatever that costs."""

DEFAULT_ON_MISS = "report"

FIDELITY_RULE_VERSION = 3
"""Scheme of the allocation and its store-key parts (patches formed under another are misses)."""


@dataclass(frozen=True)
class Allocation:
    """Per-layer ranks (one per layer of the spectra given) and what they capture and cost."""

    ranks_k: tuple[int, ...]
    ranks_v: tuple[int, ...]
    energy_k: float  # fraction of Δ_K's energy the K ranks capture (1.0 for a zero Δ_K)
    energy_v: float
    nbytes: int
    k_share: float = 0.5  # K's weight in ``energy``
    # per layer, each kept direction's storage precision (contextdeque.patch.factors); empty: the
    # allocation keeps every direction at the patch's storage dtype (the plain factor form)
    precisions_k: tuple[tuple[str, ...], ...] = ()
    precisions_v: tuple[tuple[str, ...], ...] = ()

    @property
    def energy(self) -> float:
        """K's and V's captured fractions weighed by their shares (the quantity the envelope maps
        to η)."""
        return self.k_share * self.energy_k + (1.0 - self.k_share) * self.energy_v


def direction_bytes(n_tokens: int, width: int, element_size: int) -> int:
    """Bytes one kept direction of a ``[n_tokens, width]`` Δ costs: a ``U S`` column and a
    ``V^T`` row."""
    return (int(n_tokens) + int(width)) * int(element_size)


def _objective(who: str, s2_k: torch.Tensor, s2_v: torch.Tensor, target: float | None, budget: int | None,
               weight_k: torch.Tensor | None, weight_v: torch.Tensor | None, kv_share: float | None
               ) -> tuple[int, list[torch.Tensor], list[torch.Tensor], list[float], list[float]]:
    """The allocations' shared inputs, checked: ``(L, s2 [K, V] float64 >= 0, per-layer weights
    [K, V] ([L], 1 where None), weighted totals [K, V], shares [K, V])``; with ``kv_share=None``
    each tensor's share is its part of the (weighted) total (one pool).

    Raises:
        PatchError: no target and no budget, a target outside (0, 1], malformed spectra or weights."""
    if target is None and budget is None:
        raise PatchError(f"{who} needs a target energy, a byte budget or both")
    if target is not None and not 0.0 < float(target) <= 1.0:
        raise PatchError(f"target energy must be in (0, 1], got {target}")
    if s2_k.dim() != 2 or s2_v.dim() != 2 or s2_k.shape[0] != s2_v.shape[0]:
        raise PatchError(f"spectra must be [L, r] for K and V with one L, got {tuple(s2_k.shape)} and {tuple(s2_v.shape)}")
    L = s2_k.shape[0]
    s2 = [s2_k.to(torch.float64).clamp_min(0.0), s2_v.to(torch.float64).clamp_min(0.0)]
    weights = []
    for wt in (weight_k, weight_v):
        if wt is not None and (wt.shape != (L,) or bool((wt < 0).any())):
            raise PatchError(f"per-layer weights must be [L={L}] and non-negative, got {tuple(wt.shape)}")
        weights.append(torch.ones(L, dtype=torch.float64) if wt is None else wt.to(torch.float64))
    totals = [float((s2[t] * weights[t].view(L, 1)).sum()) for t in (0, 1)]
    if kv_share is None:
        both = totals[0] + totals[1]
        share = [totals[0] / both, totals[1] / both] if both > 0 else [0.5, 0.5]
    else:
        share = [float(kv_share), 1.0 - float(kv_share)]
    return L, s2, weights, totals, share


def allocate_ranks(
    s2_k: torch.Tensor,
    s2_v: torch.Tensor,
    *,
    bytes_k: int,
    bytes_v: int,
    target: float | None = None,
    budget: int | None = None,
    weight_k: torch.Tensor | None = None,
    weight_v: torch.Tensor | None = None,
    kv_share: float | None = 0.5,
) -> Allocation:
    """Per-layer K and V ranks by greedy marginal energy per byte (see the module docstring).

    Args:
        s2_k: ``[L, r_k]`` squared singular values of Δ_K per layer, descending in each row
            (a row may be zero-padded); ``s2_v`` likewise ``[L, r_v]``.
        bytes_k, bytes_v: bytes of one K / V direction (:func:`direction_bytes`).
        target: stop as soon as the captured energy reaches this fraction (None: fill the budget).
        budget: most bytes in all (None: no cap).
        weight_k, weight_v: ``[L]`` per-layer weights of the energy (None: 1), e.g. one over the
            layer's canonical K / V energy, which counts each layer's deficit relative to its KV.
        kv_share: K's share of the objective (V has the rest): 0.5 weighs K's and V's captured
            fractions equally; None pools K and V (weighted) energy in one fraction.

    Returns the :class:`Allocation`; it falls short of ``target`` only when ``budget`` binds.
    Raises:
        PatchError: no target and no budget, a target outside (0, 1], or malformed spectra.
    """
    if min(bytes_k, bytes_v) <= 0:
        raise PatchError(f"a direction costs a positive number of bytes, got K {bytes_k} and V {bytes_v}")
    L, s2, weights, totals, share = _objective("allocate_ranks", s2_k, s2_v, target, budget, weight_k, weight_v, kv_share)
    s2 = [s2[t] * weights[t].view(L, 1) for t in (0, 1)]
    costs = (int(bytes_k), int(bytes_v))
    # candidate directions: (value per byte, value, tensor, layer); zero-energy ones are never taken
    values, tensor_ids, layer_ids = [], [], []
    for t in (0, 1):
        if totals[t] <= 0.0:
            continue
        v = share[t] * s2[t] / totals[t]
        values.append(v.reshape(-1))
        tensor_ids.append(torch.full((v.numel(),), t, dtype=torch.int64))
        layer_ids.append(torch.arange(L).repeat_interleave(v.shape[1]))
    ranks = [[0] * L, [0] * L]
    captured = [0.0, 0.0]
    spent = 0
    need = None if target is None else float(target) - 1e-12
    base = sum(share[t] for t in (0, 1) if totals[t] <= 0.0)  # a zero Δ is captured at rank 0
    if values and (need is None or base < need):
        value = torch.cat(values)
        tensor = torch.cat(tensor_ids)
        layer = torch.cat(layer_ids)
        cost = torch.tensor(costs, dtype=torch.float64)[tensor]
        # stable: equal ratios keep (tensor, layer, index) order, so each layer is taken top-down
        order = torch.argsort(-(value / cost), stable=True)
        energy = base
        for i in order.tolist():
            val = float(value[i])
            if val <= 0.0:
                break  # sorted by ratio: everything after is zero too
            t, l = int(tensor[i]), int(layer[i])
            if budget is not None and spent + costs[t] > budget:
                continue  # a cheaper tensor's directions may still fit
            ranks[t][l] += 1
            spent += costs[t]
            captured[t] += val
            energy += val
            if need is not None and energy >= need:
                break
    frac = [1.0 if totals[t] <= 0.0 or share[t] <= 0.0 else min(1.0, captured[t] / share[t]) for t in (0, 1)]
    return Allocation(tuple(ranks[0]), tuple(ranks[1]), frac[0], frac[1], spent, share[0])


def allocate_precision(
    s2_k: torch.Tensor,
    s2_v: torch.Tensor,
    *,
    costs_k: dict[str, int],
    costs_v: dict[str, int],
    errors_k: dict[str, torch.Tensor],
    errors_v: dict[str, torch.Tensor],
    target: float | None = None,
    budget: int | None = None,
    weight_k: torch.Tensor | None = None,
    weight_v: torch.Tensor | None = None,
    kv_share: float | None = 0.5,
) -> Allocation:
    """Per-layer K and V ranks *and* each kept direction's storage precision, by greedy marginal
    energy per byte (reverse water-filling over bits: a leading direction's energy pays for full
    precision, a tail direction's only for a coarse copy).

    Each direction ``j`` of a (layer, K/V) has options: dropped (0 bytes, 0 energy) or stored at
    precision ``p`` (``costs[p]`` bytes, :func:`contextdeque.patch.factors.direction_cost`;
    captured energy ``s²_j − errors[p][l, j]``, its measured error energy taken off). The options'
    upper concave hull turns a direction into a chain of upgrades with falling energy per byte;
    the chains are taken greedily by that ratio (each direction's upgrades in order, a layer's
    directions top-down: a ratio is capped at its predecessors' so order is kept). The energy is
    measured as :func:`allocate_ranks` measures it (per-layer ``weight``, ``kv_share``). With
    the one precision ``hi`` at zero error this is :func:`allocate_ranks`.

    Args:
        s2_k, s2_v: ``[L, r]`` squared singular values per layer, descending in each row.
        costs_k, costs_v: bytes of one direction at each precision considered (keys: the
            precisions, a subset of ``factors.PRECISIONS``).
        errors_k, errors_v: ``[L, r]`` error energy of each direction at each precision (same
            keys; 0 where exact).
        target, budget, weight_k, weight_v, kv_share: as in :func:`allocate_ranks`.

    Returns the :class:`Allocation` with ``precisions_k`` / ``precisions_v``.
    Raises:
        PatchError: no target and no budget, a target outside (0, 1], malformed spectra, costs
            or errors.
    """
    L, s2, weights, totals, share = _objective("allocate_precision", s2_k, s2_v, target, budget, weight_k, weight_v,
                                               kv_share)
    costs, errors = (costs_k, costs_v), (errors_k, errors_v)
    for t in (0, 1):
        if not costs[t] or set(costs[t]) != set(errors[t]) or any(int(c) <= 0 for c in costs[t].values()):
            raise PatchError("one positive byte cost and one [L, r] error table per precision are needed")
        if any(tuple(e.shape) != tuple(s2[t].shape) for e in errors[t].values()):
            raise PatchError(f"error tables must match the spectra's shape {tuple(s2[t].shape)}")
    # the options of every direction, cheapest first, and each (t, l)'s chain of hull steps
    steps: list[tuple[float, int, int, int, int, str, int, float]] = []
    for t in (0, 1):
        if totals[t] <= 0.0:
            continue
        order = sorted(costs[t], key=lambda p: int(costs[t][p]))
        scale = share[t] / totals[t]
        vals = {p: ((s2[t] - errors[t][p].to(torch.float64)).clamp_min(0.0) * weights[t].view(L, 1) * scale).tolist()
                for p in order}
        for l in range(L):
            cap = math.inf  # the previous direction's first-step ratio: a later one never outranks it
            for j in range(s2[t].shape[1]):
                hull = [(0, 0.0, "")]
                for p in order:
                    c, v = int(costs[t][p]), vals[p][l][j]
                    if v <= hull[-1][1]:
                        continue
                    while len(hull) > 1 and ((v - hull[-1][1]) * (hull[-1][0] - hull[-2][0])
                                             >= (hull[-1][1] - hull[-2][1]) * (c - hull[-1][0])):
                        hull.pop()
                    hull.append((c, v, p))
                if len(hull) == 1:
                    break  # nothing to capture here (the spectrum descends: nor further down)
                prev = cap
                for k in range(1, len(hull)):
                    dc, dv = hull[k][0] - hull[k - 1][0], hull[k][1] - hull[k - 1][1]
                    prev = min(prev, dv / dc)
                    if k == 1:
                        cap = prev
                    steps.append((prev, t, l, j, k, hull[k][2], dc, dv))
    steps.sort(key=lambda x: (-x[0], x[1], x[2], x[3], x[4]))
    level = [[[0] * s2[t].shape[1] for _ in range(L)] for t in (0, 1)]  # hull steps taken per direction
    chosen = [[[""] * s2[t].shape[1] for _ in range(L)] for t in (0, 1)]
    captured, spent = [0.0, 0.0], 0
    base = sum(share[t] for t in (0, 1) if totals[t] <= 0.0)  # a zero Δ is captured at rank 0
    energy = base
    need = None if target is None else float(target) - 1e-12
    for ratio, t, l, j, k, p, dc, dv in steps:
        if need is not None and energy >= need:
            break
        lv = level[t][l]
        if lv[j] != k - 1 or (k == 1 and j > 0 and lv[j - 1] == 0):
            continue  # its predecessor was not taken (it did not fit)
        if budget is not None and spent + dc > budget:
            continue
        lv[j], chosen[t][l][j] = k, p
        spent += dc
        captured[t] += dv
        energy += dv
    precisions: list[tuple[tuple[str, ...], ...]] = []
    for t in (0, 1):
        precisions.append(tuple(tuple(p for p in chosen[t][l] if p) for l in range(L)))
    ranks = [tuple(len(row) for row in precisions[t]) for t in (0, 1)]
    frac = [1.0 if totals[t] <= 0.0 or share[t] <= 0.0 else min(1.0, captured[t] / share[t]) for t in (0, 1)]
    return Allocation(ranks[0], ranks[1], frac[0], frac[1], spent, share[0], precisions[0], precisions[1])


def relative_weights(chunk: Any, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer weights ``([n], [n])`` counting a layer's deficit relative to its canonical K / V:
    one over the layer's K (V) energy; 0 for a layer that holds none."""
    out = []
    for t in (chunk.keys, chunk.values):
        e = t[list(layers)].to(torch.float64).pow(2).flatten(1).sum(1)
        out.append(torch.where(e > 0, 1.0 / e.clamp_min(1e-300), torch.zeros_like(e)))
    return out[0], out[1]


def rule_weights(chunk: Any, layers: tuple[int, ...], sensitivity: "LayerSensitivity | None" = None
                 ) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """The allocation's per-layer weights ``(w_k [n], w_v [n], kv_share)`` for ``chunk``'s
    patch on ``layers``: each layer's deficit relative to its canonical KV
    (:func:`relative_weights`), times the model's measured sensitivity of η to that layer's K / V
    when given (then K and V are pooled, ``kv_share=None``: the sensitivities already say how
    much K weighs against V); without it K and V are weighed equally (``kv_share=0.5``)."""
    w_k, w_v = relative_weights(chunk, layers)
    if sensitivity is None:
        return w_k, w_v, 0.5
    a_k, a_v = sensitivity.for_layers(layers)
    return w_k * a_k, w_v * a_v, None


@dataclass(frozen=True)
class LayerSensitivity:
    """How much one unit of each layer's relative K / V deficit costs in next-token KL, per model
    layer (``k[l]``, ``v[l]``; mean 1 over the layers with a deficit), measured in calibration
    (:mod:`contextdeque.eval.fidelity.envelope`). Weighing the allocation's energy by it makes
    the captured fraction a predictor of the KL a patch closes, so bytes go where η is lost."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v) or not self.k:
            raise PatchError(f"a sensitivity needs one K and one V weight per layer, got {len(self.k)} and {len(self.v)}")
        if any(not (x >= 0.0) for x in self.k + self.v):  # also refuses NaN
            raise PatchError("layer sensitivities must be finite and non-negative")

    @classmethod
    def from_envelope(cls, envelope: Any) -> "LayerSensitivity | None":
        """The sensitivities a model's envelope measured (None: no envelope, or none measured)."""
        pair = None if envelope is None else envelope.layer_sensitivity()
        return None if not pair else cls(tuple(pair[0]), tuple(pair[1]))

    def for_layers(self, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``([n], [n])`` weights of model layers ``layers``."""
        if any(not 0 <= int(l) < len(self.k) for l in layers):
            raise PatchError(f"layers {list(layers)} are outside the {len(self.k)} layers the sensitivity was measured on")
        idx = [int(l) for l in layers]
        return (torch.tensor([self.k[i] for i in idx], dtype=torch.float64),
                torch.tensor([self.v[i] for i in idx], dtype=torch.float64))

    def key(self) -> str:
        """A short digest (a patch formed under other weights is another store entry)."""
        import hashlib

        text = ",".join(f"{x:.6g}" for x in self.k + self.v)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def layer_spectra(patch: Patch) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared singular values per layer of a patch's Δ, ``([n, r_k], [n, r_v])`` (rows padded
    with zeros), read off its ``U S`` factors (column norms: ``U`` is orthonormal). Exact for a
    patch formed by SVD (every kind but a shared basis)."""
    if patch.basis_id is not None:
        raise PatchError("a shared-basis patch's factors are projections, not singular directions: no spectrum")
    out = []
    for which, ranks in zip(("k", "v"), patch.layer_ranks):
        s2 = torch.zeros(len(patch.layers), max(ranks, default=0), dtype=torch.float64)
        for i in range(len(patch.layers)):
            u, _ = patch.layer_factors(which, i)
            s2[i, : u.shape[1]] = u.to(torch.float64).pow(2).sum(0)
        out.append(s2)
    return out[0], out[1]


def precision_tables(patch: Patch, precisions: tuple[str, ...]) -> tuple[dict[str, int], dict[str, int],
                                                                        dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """What each direction of ``patch`` costs and loses at each of ``precisions``:
    ``(costs_k, costs_v, errors_k, errors_v)``, costs in bytes per direction
    (:func:`contextdeque.patch.factors.direction_cost`, ``hi`` at the patch's dtype) and errors
    ``[n, r]`` float64 error energies (:func:`contextdeque.patch.factors.direction_errors`),
    shaped like :func:`layer_spectra`'s rows."""
    hi = patch.k_u.dtype
    elem = patch.k_u.element_size()
    costs, errors = [], []
    for which, ranks in zip(("k", "v"), patch.layer_ranks):
        costs.append({p: direction_cost(p, patch.n_tokens, patch._width(which), elem) for p in precisions})
        table = {p: torch.zeros(len(patch.layers), max(ranks, default=0), dtype=torch.float64) for p in precisions}
        for i in range(len(patch.layers)):
            u, w = patch.layer_factors(which, i)
            for p in precisions:
                table[p][i, : u.shape[1]] = direction_errors(u, w, p, hi)
        errors.append(table)
    return costs[0], costs[1], errors[0], errors[1]


@dataclass(frozen=True)
class FidelityRule:
    """What a fidelity target asks of every patch a window forms.

    ``energy``: the energy to capture (from ``eta_target`` through ``envelope``, or the target
    itself read as an energy when the model has no calibrated envelope); ``max_patch_fraction``:
    the byte cap, patch bytes over the page's (None: no cap); ``on_miss``: see :data:`ON_MISS`;
    ``precisions``: the storage precisions a kept direction may take (``("hi",)``: the patch's
    storage dtype only, the plain factor form; more: each direction's precision is allocated
    with its rank, :func:`allocate_precision`, and the patch is stored mixed).
    """

    energy: float
    max_patch_fraction: float | None = None
    on_miss: str = DEFAULT_ON_MISS
    eta_target: float | None = None
    envelope: Any = None  # a model.envelope.FidelityEnvelope (energy -> η), or None
    sensitivity: LayerSensitivity | None = None  # the model's measured per-layer weights (None: equal)
    precisions: tuple[str, ...] = ("hi",)

    def __post_init__(self) -> None:
        object.__setattr__(self, "precisions", check_precisions(self.precisions))
        if not 0.0 < float(self.energy) <= 1.0:
            raise PatchError(f"target energy must be in (0, 1], got {self.energy}")
        if self.max_patch_fraction is not None and not 0.0 < float(self.max_patch_fraction) <= 1.0:
            raise PatchError(f"max_patch_fraction must be in (0, 1], got {self.max_patch_fraction}")
        if self.on_miss not in ON_MISS:
            raise PatchError(f"on_miss must be one of {ON_MISS}, got {self.on_miss!r}")

    @classmethod
    def for_target(cls, eta_target: float, envelope: Any = None, max_patch_fraction: float | None = None,
                   on_miss: str = DEFAULT_ON_MISS, precisions: tuple[str, ...] = ("hi",)) -> "FidelityRule":
        """The rule for an η target: the energy the model's ``envelope`` says reaches it (the
        target itself, read as an energy, when there is no envelope)."""
        energy = float(eta_target) if envelope is None else envelope.energy_for(float(eta_target))
        return cls(energy=energy, max_patch_fraction=max_patch_fraction, on_miss=on_miss,
                   eta_target=float(eta_target), envelope=envelope,
                   sensitivity=LayerSensitivity.from_envelope(envelope), precisions=tuple(precisions))

    @property
    def mixed(self) -> bool:
        """Whether directions may be stored below the patch's dtype (a mixed-precision patch)."""
        return self.precisions != ("hi",)

    def key_parts(self) -> list[str]:
        """What this rule adds to a patch's store key (a patch formed under another rule differs)."""
        cap = "none" if self.max_patch_fraction is None else f"{float(self.max_patch_fraction):.6g}"
        weights = "equal" if self.sensitivity is None else self.sensitivity.key()
        parts = [f"fidelity-v{FIDELITY_RULE_VERSION}", f"energy:{float(self.energy):.6g}", f"cap:{cap}",
                 f"on-miss:{self.on_miss}", f"weights:{weights}"]
        return parts + ([f"precisions:{','.join(self.precisions)}"] if self.mixed else [])

    def estimate_eta(self, energy: float) -> float | None:
        """η the envelope expects at ``energy`` (None without an envelope)."""
        return None if self.envelope is None else float(self.envelope.eta_for(energy))

    def shape(self, full: Patch, chunk: Any) -> Patch:
        """``full`` (a patch of ``chunk`` holding every direction it may keep, per layer) cut to the
        allocation this rule asks for (the byte cap: ``max_patch_fraction`` of the chunk's page
        bytes), with the decision recorded in ``meta["fidelity"]``."""
        s2_k, s2_v = layer_spectra(full)
        w_k, w_v, kv_share = rule_weights(chunk, full.layers, self.sensitivity)
        elem = full.k_u.element_size()
        plain = dict(bytes_k=direction_bytes(full.n_tokens, full._width("k"), elem),
                     bytes_v=direction_bytes(full.n_tokens, full._width("v"), elem))
        weighting = dict(weight_k=w_k, weight_v=w_v, kv_share=kv_share)
        if self.mixed:
            ck, cv, ek, ev = precision_tables(full, self.precisions)

            def allocate(**cap: Any) -> Allocation:
                return allocate_precision(s2_k, s2_v, costs_k=ck, costs_v=cv, errors_k=ek, errors_v=ev,
                                          target=self.energy, **cap, **weighting)
        else:
            def allocate(**cap: Any) -> Allocation:
                return allocate_ranks(s2_k, s2_v, target=self.energy, **cap, **plain, **weighting)
        budget = None if self.max_patch_fraction is None else int(float(self.max_patch_fraction) * chunk.nbytes)
        alloc = allocate(budget=budget)
        short = alloc.energy < self.energy - 1e-9
        action = "within-budget"
        if short and self.on_miss == "exceed_budget":
            alloc, action = allocate(), "exceeded-budget"
        elif short and self.on_miss == "recompute":  # every direction at the patch's own dtype
            have_k, have_v = full.layer_ranks
            alloc = Allocation(tuple(have_k), tuple(have_v), 1.0, 1.0,
                               sum(have_k) * int(plain["bytes_k"]) + sum(have_v) * int(plain["bytes_v"]), alloc.k_share)
            action = "recomputed"
        elif short:
            action = "reported"
        eta_est = self.estimate_eta(alloc.energy)
        meta = dict(full.meta)
        meta.update({
            "energy_target": f"{float(self.energy):.6g}", "energy_k": f"{alloc.energy_k:.6g}",
            "energy_v": f"{alloc.energy_v:.6g}",
            "fidelity": json.dumps({
                "eta_target": self.eta_target, "energy_target": round(float(self.energy), 6),
                "energy": round(alloc.energy, 6), "eta_est": None if eta_est is None else round(eta_est, 6),
                "calibrated": self.envelope is not None, "bytes": alloc.nbytes, "budget_bytes": budget,
                "miss": alloc.energy < self.energy - 1e-9, "shortfall": short, "action": action,
                "weights": "equal" if self.sensitivity is None else "sensitivity",
                "precisions": {p: sum(row.count(p) for rows in (alloc.precisions_k, alloc.precisions_v) for row in rows)
                               for p in PRECISIONS} if alloc.precisions_k else None,
            }, sort_keys=True),
        })
        if alloc.precisions_k:
            shaped = mix_patch(full, alloc.precisions_k, alloc.precisions_v)
        else:
            shaped = cut_patch(full, alloc.ranks_k, alloc.ranks_v)
        return dataclasses.replace(shaped, meta=meta)


def fidelity_report(patch: Any) -> dict[str, Any] | None:
    """What the fidelity rule decided for ``patch`` (see :meth:`FidelityRule.shape`): η target,
    energy target and captured, estimated η, bytes and byte budget, ``miss`` (the patch falls
    short of the target), ``shortfall`` (the cap could not meet it) and ``action``
    (``within-budget`` / ``reported`` / ``exceeded-budget`` / ``recomputed``). None for a patch
    formed without a target."""
    raw = getattr(patch, "meta", {}).get("fidelity")
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None
