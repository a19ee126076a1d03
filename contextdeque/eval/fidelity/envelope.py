"""The fidelity envelope on the probe set: how captured energy maps to η for a model (its
calibration), and what η and bytes a ``fidelity_target`` gets against fixed ranks.

Per probe item (its chunks in order, as in the harness's main group): the re-prefill reference,
blind reuse, and exact full-rank patches chained as a window holds them. Every variant is a cut
of the same full patches (an SVD truncated is the top-m SVD), so variants differ only in which
directions they keep:

- ``fixed-r{m}``: rank m on every layer, K and V;
- ``energy-{e}``: the allocation (``contextdeque.patch.alloc``: per layer and K/V, greedy energy
  per byte) capturing energy e, no byte cap — the calibration's points;
- ``target-{t}``: a window's rule for η target t (through the model's envelope) under the byte
  cap ``max_patch_fraction`` of each page, misses reported;
- ``fixed-r{m}-{p}``: rank m on every layer, every direction stored at precision p (int8 /
  int4: :mod:`contextdeque.patch.factors`) — the fair baseline of a mixed-precision arm;
- ``...-mixed``: an energy or target arm whose rule allocates each direction's precision with
  its rank (``--precisions hi,int8,int4``).

Each variant's next-token KL against re-prefill gives η (items with a measurable blind gap only).

    python -m contextdeque.eval.fidelity.envelope --items 8 --ranks 8,16,24,32,64 \
        --targets 0.95,0.97,0.98,0.99,0.995 --max-patch-fraction 0.25 --json out.json
    python -m contextdeque.eval.fidelity.envelope --arch qwen2   # a tiny random non-llama family
    python -m contextdeque.eval.fidelity.envelope --model DIR_OR_GGUF   # another checkpoint
    python -m contextdeque.eval.fidelity.envelope --uniform-precisions hi,int8 \
        --precisions "hi;hi,int8,int4" --energies 0.9,0.95,0.99   # bytes allocated, not only rank
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from ...core.chunk import Chunk
from ...core.metrics import kl_divergence, kl_divergence_tensor
from ...model.envelope import CURVE_QUANTILE, ENVELOPE_VERSION, FidelityEnvelope, load_envelope, save_envelope
from ...patch import FidelityRule, LayerSensitivity, Patch, fidelity_report, form_patch
from ...patch.alloc import layer_spectra, rule_weights
from ...patch.factors import PRECISIONS, check_precisions
from ...patch.ops import cut_patch, mix_patch, truncate_patch
from ..arms import BlindArm, PatchArm, ReprefillArm, ReuseRequest
from .harness import score_query
from .metrics import DEFAULT_MIN_GAP, eta, percentile
from .probes import ProbeItem, materialize, probe_set

FIXED_RANKS = (16, 32, 64)
TARGETS = (0.95, 0.99)
CALIBRATION_ENERGIES = (0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999)
CALIBRATION_PER_FAMILY = 4
"""Probe items per family the calibration measures: the *last* ones of each family, so the first
items of the interleaved probe set (what ``contextdeque fidelity --items N`` checks, N <= 14) are
held out."""


def calibration_items(per_family: int = CALIBRATION_PER_FAMILY) -> list[ProbeItem]:
    """The calibration's probe items (deterministic): the last ``per_family`` of each family."""
    items = probe_set()
    out: list[ProbeItem] = []
    for fam in dict.fromkeys(i.family for i in items):
        out += [i for i in items if i.family == fam][-int(per_family):]
    return out


@dataclass
class ItemBase:
    """One probe item, measured once: the request, the reference logits, blind reuse's KL and the
    exact full-rank patch of every non-leading chunk (index -> patch)."""

    item_id: str
    request: ReuseRequest
    start: int
    query_ids: list[int]
    ref_logits: torch.Tensor
    kl_blind: float
    full: dict[int, Patch]

    def kv_with(self, patches: dict[int, Patch]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The item's KV (per layer ``[H, S, d]``) when chunk ``i`` carries ``patches[i]``."""
        return PatchArm("full").run(self.request.with_patches({i: [p] for i, p in patches.items()})).kv

    def kl_with(self, backend: Any, patches: dict[int, Patch]) -> float:
        """Next-token KL against the re-prefill when chunk ``i`` carries ``patches[i]``."""
        logits, _ = score_query(backend, self.kv_with(patches), self.start, self.query_ids, 0)
        return kl_divergence(self.ref_logits, logits)


def item_bases(backend: Any, items: Sequence[ProbeItem], *, max_chunk_tokens: int = 512,
               image_grid: tuple[int, int] | None = None, skipped: list[str] | None = None) -> Iterator[ItemBase]:
    """:class:`ItemBase` per item with at least two chunks; items that would run past the model's
    trained context are left out (their ids appended to ``skipped``)."""
    limit = getattr(backend.layout, "max_trained_position", None)
    for item in items:
        mat = materialize(item, backend, max_chunk_tokens=max_chunk_tokens, image_grid=image_grid)
        if len(mat.chunks) < 2:
            continue
        req = ReuseRequest(backend, mat.chunks)
        start = req.next_position
        if limit is not None and start + len(mat.query_ids) > limit:
            if skipped is not None:
                skipped.append(item.id)
            continue
        ref_logits, _ = score_query(backend, ReprefillArm().run(req).kv, start, mat.query_ids, 0)
        blind_logits, _ = score_query(backend, BlindArm().run(req).kv, start, mat.query_ids, 0)
        full: dict[int, Patch] = {}
        for i in range(1, len(req.chunks)):
            ants = [(req.chunks[j], [full[j]] if j in full else None) for j in range(i)]
            full[i] = form_patch(backend, req.chunks[i], ants, rank="full", kind="exact")
        yield ItemBase(item.id, req, start, list(mat.query_ids), ref_logits, kl_divergence(ref_logits, blind_logits), full)


@dataclass
class Variant:
    """One way of cutting the full patches: ``cut(patch, chunk) -> patch``."""

    name: str
    kind: str  # "fixed" / "energy" / "target"
    param: float
    cut: Callable[[Patch, Chunk], Patch]
    kl: list[float] = field(default_factory=list)
    eta: list[float | None] = field(default_factory=list)
    energy: list[float] = field(default_factory=list)
    bytes: int = 0
    page_bytes: int = 0
    ranks_k: list[int] = field(default_factory=list)  # per patch: directions kept over all layers
    ranks_v: list[int] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)  # per patch: layers carrying a correction
    misses: int = 0
    estimated: list[float] = field(default_factory=list)  # per patch: the rule's estimated η
    precisions: dict[str, int] = field(default_factory=dict)  # directions kept at each precision
    sensitivity: LayerSensitivity | None = None  # the weights ``energy`` is measured in

    def measure(self, backend: Any, base: ItemBase, min_gap: float) -> None:
        pats: dict[int, Patch] = {}
        energies, weights = [], []
        for i, p in base.full.items():
            chunk = base.request.chunks[i]
            q = self.cut(p, chunk)
            pats[i] = q
            self.bytes += q.nbytes
            self.page_bytes += chunk.nbytes
            rk, rv = q.layer_ranks
            self.ranks_k.append(sum(rk))
            self.ranks_v.append(sum(rv))
            self.layers.append(sum(1 for a, b in zip(rk, rv) if a or b))
            counts = q.mixed.counts() if q.mixed is not None else {"hi": sum(rk) + sum(rv)}
            for prec, n in counts.items():
                self.precisions[prec] = self.precisions.get(prec, 0) + n
            energies.append(captured(p, q, chunk, self.sensitivity))
            weights.append(chunk.n_tokens)
            rep = fidelity_report(q)
            if rep is not None:
                self.misses += bool(rep["miss"])
                if rep.get("eta_est") is not None:
                    self.estimated.append(float(rep["eta_est"]))
        kl = base.kl_with(backend, pats)
        self.kl.append(kl)
        self.eta.append(eta(base.kl_blind, kl, min_gap))
        self.energy.append(sum(e * w for e, w in zip(energies, weights)) / sum(weights))

    def row(self) -> dict[str, Any]:
        etas = [e for e in self.eta if e is not None]
        n = len(self.ranks_k)
        return {
            "variant": self.name, "kind": self.kind, "param": self.param,
            "median_eta": statistics.median(etas) if etas else None, "p10_eta": percentile(etas, 0.1),
            "min_eta": min(etas) if etas else None, "n_eta": len(etas),
            "median_kl": statistics.median(self.kl) if self.kl else None,
            "median_energy": statistics.median(self.energy) if self.energy else None,
            "patch_bytes": self.bytes, "bytes_fraction": self.bytes / self.page_bytes if self.page_bytes else None,
            "patches": n, "misses": self.misses,
            "mean_rank_k": sum(self.ranks_k) / max(1, sum(self.layers)) if n else None,
            "mean_rank_v": sum(self.ranks_v) / max(1, sum(self.layers)) if n else None,
            "mean_layers": sum(self.layers) / n if n else None,
            "median_estimated_eta": statistics.median(self.estimated) if self.estimated else None,
            "directions_by_precision": dict(self.precisions),
        }


def layer_energies(full: Patch, cut: Patch, which: str) -> dict[int, tuple[float, float]]:
    """Per layer of ``full``: ``(‖Δ‖², ‖Δ − Δ_cut‖²)`` of ``which`` (``"k"`` / ``"v"``), Δ being
    ``full``'s product of factors and ``Δ_cut`` ``cut``'s (dequantized), from the factors' Gram
    matrices (no dense Δ): exact whatever ``cut`` dropped or stored coarsely."""

    def gram(u1: torch.Tensor, w1: torch.Tensor, u2: torch.Tensor, w2: torch.Tensor) -> float:
        u1, w1, u2, w2 = (x.to(torch.float64) for x in (u1, w1, u2, w2))
        return float(((u1.T @ u2) * (w1 @ w2.T)).sum())

    at = {l: i for i, l in enumerate(cut.layers)}
    out = {}
    for i, l in enumerate(full.layers):
        u, w = full.layer_factors(which, i)
        total = gram(u, w, u, w)
        if l not in at:
            out[l] = (total, total)
            continue
        cu, cw = cut.layer_factors(which, at[l])
        out[l] = (total, max(0.0, total - 2.0 * gram(u, w, cu, cw) + gram(cu, cw, cu, cw)))
    return out


def captured(full: Patch, cut: Patch, chunk: Chunk, sensitivity: LayerSensitivity | None = None) -> float:
    """Energy of ``full``'s Δ that ``cut`` captures, ``1 − ‖Δ − Δ_cut‖² / ‖Δ‖²`` in the rule's
    measure (each layer's deficit relative to ``chunk``'s KV, weighed by ``sensitivity`` with K
    and V pooled, or K and V weighed equally without it:
    :func:`contextdeque.patch.alloc.rule_weights`), from the residual of the dequantized factors
    (:func:`layer_energies`) — independent of the allocation that chose ``cut`` and of its own
    accounting of what a precision loses."""
    w_k, w_v, kv_share = rule_weights(chunk, full.layers, sensitivity)
    weights = {"k": dict(zip(full.layers, w_k.tolist())), "v": dict(zip(full.layers, w_v.tolist()))}
    tot, got = {}, {}
    for t in ("k", "v"):
        per = layer_energies(full, cut, t)
        tot[t] = sum(weights[t][l] * e for l, (e, _) in per.items())
        got[t] = sum(weights[t][l] * (e - r) for l, (e, r) in per.items())
    if kv_share is None:
        both = tot["k"] + tot["v"]
        return 1.0 if both <= 0 else (got["k"] + got["v"]) / both
    frac = {t: 1.0 if tot[t] <= 0 else got[t] / tot[t] for t in ("k", "v")}
    return kv_share * frac["k"] + (1.0 - kv_share) * frac["v"]


def fixed_variant(rank: int, precision: str = "hi") -> Variant:
    """Rank ``rank`` on every layer, K and V; every direction at ``precision`` (``hi``: the
    patch's storage dtype)."""
    def cut(p: Patch, c: Chunk) -> Patch:
        q = truncate_patch(p, min(rank, p.rank_k), min(rank, p.rank_v))
        if precision == "hi":
            return q
        rk, rv = q.layer_ranks
        return mix_patch(q, [[precision] * m for m in rk], [[precision] * m for m in rv])

    name = f"fixed-r{rank}" + ("" if precision == "hi" else f"-{precision}")
    return Variant(name, "fixed" if precision == "hi" else f"fixed-{precision}", rank, cut)


def mixed_suffix(precisions: Sequence[str]) -> str:
    """A variant name's suffix for a rule's precision set (none for the plain one)."""
    return "" if tuple(precisions) == ("hi",) else "-mixed" if set(precisions) == set(PRECISIONS) \
        else "-" + "+".join(precisions)


def energy_variant(energy: float, sensitivity: LayerSensitivity | None = None,
                   precisions: Sequence[str] = ("hi",)) -> Variant:
    rule = FidelityRule(energy=energy, sensitivity=sensitivity, precisions=tuple(precisions))
    suffix = mixed_suffix(rule.precisions)
    return Variant(f"energy-{energy:g}{suffix}", "energy" + suffix, energy, lambda p, c: rule.shape(p, c),
                   sensitivity=sensitivity)


def target_variant(target: float, envelope: FidelityEnvelope | None, max_patch_fraction: float | None,
                   on_miss: str = "report", name: str | None = None, precisions: Sequence[str] = ("hi",)) -> Variant:
    rule = FidelityRule.for_target(target, envelope, max_patch_fraction, on_miss, precisions=tuple(precisions))
    suffix = mixed_suffix(rule.precisions)
    return Variant((name or f"target-{target:g}") + suffix, "target" + suffix, target, lambda p, c: rule.shape(p, c),
                   sensitivity=rule.sensitivity)


SENSITIVITY_PROBE_ENERGY = 0.75
"""Where the sensitivities are probed: every layer keeps the fewest top directions holding this
fraction of its Δ energy, so the KL measured is that of tails like the ones a target leaves, not
of whole deficits."""

NEGLIGIBLE_DEFICIT = 1e-6
"""A (layer, K/V) whose relative deficit is below this fraction of the item's largest is not
probed (its sensitivity stays unmeasured; layer 0's KV sees no context, its Δ is rounding)."""


def probe_ranks(s2: torch.Tensor, energy: float) -> list[int]:
    """Per row of descending squared singular values ``[n, r]``: the fewest leading entries
    holding ``energy`` of the row's sum (0 for a zero row)."""
    out = []
    for row in s2:
        tot = float(row.sum())
        out.append(0 if tot <= 0 else int((row.cumsum(0) < energy * tot).sum().item()) + 1)
    return [min(m, s2.shape[1]) for m in out]


def query_logits(backend: Any, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int,
                 query_ids: Sequence[int]) -> torch.Tensor:
    """Next-token logits ``[vocab]`` after prefilling ``query_ids`` at ``start..`` over ``kv`` (per
    layer ``[H, S, d]``), differentiable in ``kv``: the first step of
    :func:`contextdeque.window.decode.greedy_steps` (which runs without gradients)."""
    from ...core import compat

    dev = backend.device
    cache = compat.cache_from_layers([(k.unsqueeze(0).to(dev), v.unsqueeze(0).to(dev)) for k, v in kv])
    ids = torch.as_tensor([int(t) for t in query_ids], dtype=torch.long, device=dev).reshape(1, -1)
    n, past = ids.shape[1], kv[0][0].shape[1]
    out = backend.model(input_ids=ids, position_ids=backend.position_ids(backend.text_positions(start, n)),
                        past_key_values=cache, attention_mask=torch.ones(1, past + n, dtype=torch.long, device=dev),
                        use_cache=True, logits_to_keep=1)
    backend.count_forward(n)
    return out.logits[0, -1].to(torch.float32)


SENSITIVITY_SAMPLES = 8
"""Random-sign probes per item (each one forward and one backward pass)."""


def item_sensitivity(backend: Any, base: ItemBase, n_layers: int, probe_energy: float = SENSITIVITY_PROBE_ENERGY,
                     samples: int = SENSITIVITY_SAMPLES, seed: int = 0) -> tuple[list[float], list[float]] | None:
    """One item's per-layer sensitivities ``(K [n_layers], V [n_layers])``, NaN where not measured.

    Every (layer, K/V) ``l`` of every patch of the item is cut to its ``probe_energy`` top
    directions, leaving out a residual ``r_l`` of relative energy ``E_l``. Near the full patch the
    next-token KL is quadratic in the residual left out: with the KV ``full − Σ β_l r_l``,
    ``KL(β) ≈ ½ βᵀ G β``. The sensitivity is the diagonal per unit energy, ``a_l = G_ll / 2E_l``
    (were KL a sum of per-layer terms ``a_l E_l β_l²``, this is its ``a_l``). ``G``'s diagonal is
    estimated without a forward per layer: at random signs ``β = z`` one backward pass gives
    ``∇KL = G z``, and ``z ⊙ G z`` averages to ``diag G`` (Hutchinson) over ``samples`` draws
    (deterministic: ``seed``). Values are over the KL of the cut itself (β = 1), so items weigh
    alike; a negative estimate (noise) stays in, for the average over items to cancel."""
    spectra = {i: layer_spectra(p) for i, p in base.full.items()}
    weights = {i: rule_weights(base.request.chunks[i], p.layers)[:2] for i, p in base.full.items()}
    deficit = [[0.0] * n_layers, [0.0] * n_layers]
    for i, p in base.full.items():
        for t in (0, 1):
            for j, layer in enumerate(p.layers):
                deficit[t][layer] += float(weights[i][t][j]) * float(spectra[i][t][j].sum())
    floor = NEGLIGIBLE_DEFICIT * max(max(row) for row in deficit)
    left_out = [[0.0] * n_layers, [0.0] * n_layers]
    cut: dict[int, Patch] = {}
    for i, p in base.full.items():
        ranks = [list(r) for r in p.layer_ranks]
        for t in (0, 1):
            for j, layer in enumerate(p.layers):
                if deficit[t][layer] <= floor:
                    continue  # kept whole: nothing to measure there
                row = spectra[i][t][j]
                m = min(probe_ranks(row.view(1, -1), probe_energy)[0], ranks[t][j])
                ranks[t][j] = m
                left_out[t][layer] += float(weights[i][t][j]) * float(row[m:].sum())
        cut[i] = cut_patch(p, ranks[0], ranks[1])
    kv_cut, kv_full = base.kv_with(cut), base.kv_with(base.full)
    with torch.no_grad():
        kl_cut = kl_divergence(base.ref_logits, query_logits(backend, kv_cut, base.start, base.query_ids))
    if kl_cut <= 0.0:
        return None
    resid = [(kf - kc, vf - vc) for (kc, vc), (kf, vf) in zip(kv_cut, kv_full)]
    gen = torch.Generator().manual_seed(int(seed))
    diag = torch.zeros(2, len(resid), dtype=torch.float64)
    for _ in range(max(1, int(samples))):
        z = torch.randint(0, 2, (2, len(resid)), generator=gen).to(kv_full[0][0].dtype) * 2 - 1
        beta = z.clone().requires_grad_(True)
        with torch.enable_grad():
            kv = [(kf - beta[0, l] * rk, vf - beta[1, l] * rv) for l, ((kf, vf), (rk, rv)) in enumerate(zip(kv_full, resid))]
            kl = kl_divergence_tensor(base.ref_logits, query_logits(backend, kv, base.start, base.query_ids))
            (grad,) = torch.autograd.grad(kl, beta)
        diag += (z * grad).to(torch.float64)
    diag /= max(1, int(samples))
    sens = [[math.nan] * n_layers, [math.nan] * n_layers]
    for t in (0, 1):
        for layer in range(min(n_layers, diag.shape[1])):
            if left_out[t][layer] > 0.0 and deficit[t][layer] > floor:
                sens[t][layer] = float(diag[t, layer]) / (2.0 * left_out[t][layer] * kl_cut)
    return sens[0], sens[1]


SENSITIVITY_FLOOR = 0.02
"""The least weight a measured (layer, K/V) keeps, over the mean: an estimate at or below zero is
noise around a small value, and a zero weight would never give that layer a direction."""


def aggregate_sensitivity(per_item: Sequence[tuple[list[float], list[float]]]) -> LayerSensitivity:
    """The model's sensitivity: per (layer, K/V) the mean over the items that measured it (0
    where none did: no deficit there to weigh), normalized to mean 1 over the measured ones and
    floored at :data:`SENSITIVITY_FLOOR`."""
    n = len(per_item[0][0])
    avg: list[list[float | None]] = [[None] * n, [None] * n]
    for t in (0, 1):
        for l in range(n):
            vals = [item[t][l] for item in per_item if not math.isnan(item[t][l])]
            avg[t][l] = sum(vals) / len(vals) if vals else None
    measured = [max(0.0, x) for row in avg for x in row if x is not None]
    mean = sum(measured) / len(measured) if measured and sum(measured) > 0 else 1.0
    k, v = ([0.0 if x is None else max(SENSITIVITY_FLOOR, x / mean) for x in row] for row in avg)
    return LayerSensitivity(tuple(round(x, 6) for x in k), tuple(round(x, 6) for x in v))


@torch.no_grad()
def run_variants(backend: Any, items: Sequence[ProbeItem], variants: Sequence[Variant], *, max_chunk_tokens: int = 512,
                 image_grid: tuple[int, int] | None = None, min_gap: float = DEFAULT_MIN_GAP) -> dict[str, Any]:
    """Measure every variant on ``items``; returns ``{"variants": [row...], "items": n, ...}``."""
    skipped: list[str] = []
    blind: list[float] = []
    for base in item_bases(backend, items, max_chunk_tokens=max_chunk_tokens, image_grid=image_grid, skipped=skipped):
        blind.append(base.kl_blind)
        for v in variants:
            v.measure(backend, base, min_gap)
    return {"variants": [v.row() for v in variants], "items": len(blind),
            "items_with_gap": sum(1 for k in blind if k > min_gap), "items_past_trained_context": skipped}


@torch.no_grad()
def calibrate_envelope(backend: Any, items: Sequence[ProbeItem] | None = None, *,
                       energies: Sequence[float] = CALIBRATION_ENERGIES, max_chunk_tokens: int = 512,
                       image_grid: tuple[int, int] | None = None, min_gap: float = DEFAULT_MIN_GAP,
                       sensitivity: bool = False, probe_energy: float = SENSITIVITY_PROBE_ENERGY,
                       quantile: float = CURVE_QUANTILE) -> FidelityEnvelope:
    """Measure the model's envelope on ``items`` (default :func:`calibration_items`): first, with
    ``sensitivity``, each layer's K and V sensitivity (:func:`item_sensitivity`, median over the
    items); then η (every item's, its median and 10th percentile) of the uncapped allocation,
    weighed by those sensitivities, at each energy in ``energies``. Deterministic: the same
    model, items and code give the same envelope.

    Raises:
        EnvelopeError: no item leaves blind reuse a measurable gap (nothing to calibrate on)."""
    from ...core.errors import EnvelopeError

    t0 = time.perf_counter()
    items = list(calibration_items() if items is None else items)
    bases = list(item_bases(backend, items, max_chunk_tokens=max_chunk_tokens, image_grid=image_grid))
    gapped = [b for b in bases if b.kl_blind > min_gap]
    if not gapped:
        raise EnvelopeError(f"no calibration item leaves blind reuse a gap above {min_gap:g} nats on "
                            f"{getattr(backend, 'name', 'this model')}: nothing to calibrate η on")
    sens = None
    t_sens = time.perf_counter()
    if sensitivity:
        n_layers = int(backend.layout.num_layers)
        per_item = [x for x in (item_sensitivity(backend, b, n_layers, probe_energy, seed=k)
                                for k, b in enumerate(gapped)) if x is not None]
        sens = aggregate_sensitivity(per_item) if per_item else None
    t_sens = time.perf_counter() - t_sens
    variants = [energy_variant(e, sens) for e in energies]
    for b in bases:
        for v in variants:
            v.measure(backend, b, min_gap)
    rows = [v.row() for v in variants]
    return FidelityEnvelope(
        fingerprint=backend.fingerprint, model=str(getattr(backend, "name", "")),
        energies=tuple(float(e) for e in energies), median_eta=tuple(float(r["median_eta"]) for r in rows),
        p10_eta=tuple(float(r["p10_eta"]) for r in rows),
        mean_bytes_fraction=tuple(float(r["bytes_fraction"] or 0.0) for r in rows),
        n_items=int(rows[0]["n_eta"]), items=tuple(i.id for i in items), version=ENVELOPE_VERSION,
        seconds=round(time.perf_counter() - t0, 3),
        item_eta=tuple(tuple(float(e) for e in v.eta if e is not None) for v in variants), quantile=float(quantile),
        sensitivity_k=() if sens is None else sens.k, sensitivity_v=() if sens is None else sens.v,
        sensitivity_seconds=round(t_sens, 3),
    )


def ensure_envelope(backend: Any, *, refresh: bool = False, **kw: Any) -> FidelityEnvelope:
    """The model's envelope: the cached one (keyed by the weights' fingerprint), else calibrated
    now and cached. ``refresh``: calibrate again even when cached."""
    env = None if refresh else load_envelope(backend.fingerprint)
    if env is None:
        env = calibrate_envelope(backend, **kw)
        save_envelope(env)
    return env


def plot_envelope(summary: dict[str, Any], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    styles = ("o-", "^:", "s-", "d--", "v-.", "x:")
    kinds = list(dict.fromkeys(r["kind"] for r in summary["variants"]))
    for kind, style in zip(kinds, styles * 4):
        rows = [r for r in summary["variants"] if r["kind"] == kind and r["median_eta"] is not None]
        if not rows:
            continue
        ax.plot([r["patch_bytes"] / 2**20 for r in rows], [r["median_eta"] for r in rows], style, label=kind)
        for r in rows:
            ax.annotate(r["variant"], (r["patch_bytes"] / 2**20, r["median_eta"]), fontsize=7)
    ax.set_xlabel("patch bytes over the probe items (MiB)")
    ax.set_ylabel("median η")
    ax.set_title(title or "η per patch byte")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m contextdeque.eval.fidelity.envelope", description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=None, help="first N probe items (default: all 36)")
    ap.add_argument("--arch", default=None, help="a tiny random architecture (contextdeque.model.testing) instead of the default model")
    ap.add_argument("--model", default=None, help="a local checkpoint (HF directory or .gguf) instead of the default model")
    ap.add_argument("--calibration-per-family", type=int, default=CALIBRATION_PER_FAMILY,
                    help="calibration items per probe family when the model has no cached envelope")
    ap.add_argument("--sensitivity", action="store_true",
                    help="calibrate per-layer K/V sensitivities and weigh the allocation by them (opt-in: "
                         "measured worse than equal weights on two models, docs/fidelity.md)")
    ap.add_argument("--quantile", type=float, default=None,
                    help="read the target map at this quantile of the calibration items' η (default: the envelope's)")
    ap.add_argument("--ranks", default=",".join(map(str, FIXED_RANKS)))
    ap.add_argument("--uniform-precisions", default="hi",
                    help="the fixed-rank arms at each of these precisions (hi, int8, int4), comma-separated")
    ap.add_argument("--precisions", default="hi",
                    help="precision sets of the target (and --energies) arms, ';'-separated, each comma-separated "
                         "(e.g. 'hi;hi,int8,int4': the plain rule and the mixed-precision one)")
    ap.add_argument("--energies", default="",
                    help="uncapped energy arms (the allocation at these energies, per precision set)")
    ap.add_argument("--targets", default=",".join(map(str, TARGETS)))
    ap.add_argument("--max-patch-fraction", default="0.25",
                    help="the targets' byte caps, comma-separated ('none': no cap); one target arm per target and cap")
    ap.add_argument("--on-miss", default="report", help="comma-separated on_miss values; one target arm per value")
    ap.add_argument("--max-chunk-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared, busy CPU)")
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("--plot", default=None, help="write the figure here (PNG)")
    args = ap.parse_args(argv)
    from ...model.threads import apply_threads

    apply_threads(max(1, args.threads))  # explicit: a model loaded below keeps it
    if args.arch:
        from ...model.testing import tiny_backend

        be, grid = tiny_backend(args.arch), (4, 4)
    else:
        from ...model import load_model

        be, grid = load_model(args.model), None
    env = ensure_envelope(be, items=calibration_items(args.calibration_per_family), sensitivity=args.sensitivity,
                          max_chunk_tokens=args.max_chunk_tokens, image_grid=grid)
    if args.quantile is not None:
        env = dataclasses.replace(env, quantile=float(args.quantile))
    sets = [check_precisions([p.strip() for p in g.split(",") if p.strip()]) for g in args.precisions.split(";") if g.strip()]
    variants = [fixed_variant(int(r), p.strip()) for p in args.uniform_precisions.split(",") if p.strip()
                for r in args.ranks.split(",") if r]
    caps = [None if c.strip() == "none" else float(c) for c in args.max_patch_fraction.split(",") if c.strip()]
    misses = [m.strip() for m in args.on_miss.split(",") if m.strip()]
    for prec in sets:
        variants += [energy_variant(float(e), precisions=prec) for e in args.energies.split(",") if e.strip()]
        for t in (float(x) for x in args.targets.split(",") if x):
            for cap in caps:
                for m in misses:
                    name = f"target-{t:g}" if len(caps) == len(misses) == 1 else f"target-{t:g}@{cap}-{m}"
                    variants.append(target_variant(t, env, cap, m, name, prec))
    s = run_variants(be, probe_set(args.items), variants, max_chunk_tokens=args.max_chunk_tokens, image_grid=grid)
    s["model"] = getattr(be, "name", str(args.arch))
    s["envelope"] = env.as_dict()
    for r in s["variants"]:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1, sort_keys=True)
    if args.plot:
        plot_envelope(s, args.plot, title=str(s["model"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
