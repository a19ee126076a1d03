"""A model's calibrated fidelity envelope: how the captured energy of a patch maps to η.

η = 1 − KL(patch) / KL(blind) is next-token fidelity against a full re-prefill (1: the patch
closes the whole gap blind reuse leaves; 0: no better than blind). How much of Δ's energy a patch
must capture to reach a given η differs by model family, so a ``fidelity_target`` in η is turned
into an energy through the envelope measured on that model (``contextdeque calibrate --model``,
``contextdeque.eval.fidelity.envelope.calibrate_envelope``).

The envelope is cached beside the layout proofs (``<cache>/proofs/envelope-<fingerprint>.json``),
keyed by the weights' fingerprint: editing a weight is another model, with no envelope until it
is calibrated again. Measuring it needs the probe set (the eval layer); this module only holds
the map and its cache, so a window reads it without importing upward.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from ..core.errors import EnvelopeError
from ..core.metrics import percentile
from .detect import _DISK, _proof_dir

ENVELOPE_VERSION = 4
"""Scheme of the calibration (probe items, energy grid, statistic, per-layer sensitivities): part
of the cache file name."""

CURVE_QUANTILE = 0.25
"""Which quantile of the calibration items' η the target map reads: the lower quartile, fixed a
priori (the median of v3 landed 0.01-0.07 under its targets on the harder held-out items;
docs/fidelity.md has what the quartile gives)."""


@dataclass(frozen=True)
class FidelityEnvelope:
    """Measured (energy, η) points of one model (``fingerprint``).

    ``energies``: the allocation's energy targets, ascending; ``median_eta`` / ``p10_eta``: the
    median and 10th-percentile η over the probe items with a measurable blind gap (``n_items``)
    at each; ``item_eta``: every such item's η at each energy; ``mean_bytes_fraction``: patch
    bytes over page bytes at each. ``sensitivity_k`` / ``sensitivity_v``: per model layer, the KL
    one unit of that layer's relative K / V deficit costs (mean 1; empty: not measured, K and V
    and every layer weighed equally), which the allocation's energy is weighed by
    (``contextdeque.patch.alloc.LayerSensitivity``). The map used for targets is the ``quantile``
    of ``item_eta`` (the median where item η were not kept), made monotone conservatively (a
    point never exceeds any point at a higher energy), anchored at (0, 0) (blind) and (1, 1)
    (every direction: the exact conditioning)."""

    fingerprint: str
    model: str
    energies: tuple[float, ...]
    median_eta: tuple[float, ...]
    p10_eta: tuple[float, ...]
    mean_bytes_fraction: tuple[float, ...]
    n_items: int
    items: tuple[str, ...]
    version: int = ENVELOPE_VERSION
    seconds: float = field(default=0.0, compare=False)  # wall time: not part of what was measured
    cached: bool = False
    item_eta: tuple[tuple[float, ...], ...] = ()
    quantile: float = CURVE_QUANTILE
    sensitivity_k: tuple[float, ...] = ()
    sensitivity_v: tuple[float, ...] = ()
    sensitivity_seconds: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        if not self.energies or len(self.median_eta) != len(self.energies):
            raise EnvelopeError(f"an envelope needs one median η per energy, got {len(self.energies)} energies "
                                f"and {len(self.median_eta)} medians")
        if list(self.energies) != sorted(self.energies) or not all(0.0 < e < 1.0 for e in self.energies):
            raise EnvelopeError(f"envelope energies must ascend inside (0, 1), got {list(self.energies)}")
        if self.item_eta and len(self.item_eta) != len(self.energies):
            raise EnvelopeError(f"item η per energy: {len(self.item_eta)} rows for {len(self.energies)} energies")
        if len(self.sensitivity_k) != len(self.sensitivity_v):
            raise EnvelopeError(f"sensitivities: {len(self.sensitivity_k)} K and {len(self.sensitivity_v)} V layers")

    def map_eta(self) -> list[float]:
        """η per energy the target map reads: the ``quantile`` of the items' η (the median
        without them)."""
        if not self.item_eta or not all(self.item_eta):
            return list(self.median_eta)
        return [float(percentile(row, self.quantile)) for row in self.item_eta]

    def layer_sensitivity(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """``(K, V)`` per-layer sensitivities, or None when calibration did not measure them."""
        return (self.sensitivity_k, self.sensitivity_v) if self.sensitivity_k else None

    def curve(self) -> list[tuple[float, float]]:
        """The monotone (energy, η) curve targets are read from, anchors included."""
        etas = self.map_eta()
        for i in range(len(etas) - 2, -1, -1):  # conservative: never above a higher energy's η
            etas[i] = min(etas[i], etas[i + 1])
        pts = [(0.0, 0.0)] + [(e, max(0.0, min(1.0, h))) for e, h in zip(self.energies, etas)] + [(1.0, 1.0)]
        return pts

    def eta_for(self, energy: float) -> float:
        """Estimated η of a patch capturing ``energy`` (piecewise linear on :meth:`curve`)."""
        e = max(0.0, min(1.0, float(energy)))
        pts = self.curve()
        for (e0, h0), (e1, h1) in zip(pts, pts[1:]):
            if e <= e1:
                return h0 if e1 == e0 else h0 + (h1 - h0) * (e - e0) / (e1 - e0)
        return 1.0

    def energy_for(self, eta: float) -> float:
        """The least energy whose estimated η reaches ``eta`` (1.0: every direction)."""
        t = float(eta)
        pts = self.curve()
        for (e0, h0), (e1, h1) in zip(pts, pts[1:]):
            if h1 >= t:
                if h1 == h0 or h0 >= t:
                    return e0 if h0 >= t else e1
                return min(1.0, e0 + (e1 - e0) * (t - h0) / (h1 - h0))
        return 1.0

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One line: items, and the energy each η target needs."""
        need = ", ".join(f"η {t:g} <- energy {self.energy_for(t):.4f}" for t in (0.9, 0.95, 0.99))
        weights = "per-layer sensitivities" if self.sensitivity_k else "equal layer weights"
        return (f"calibrated on {self.n_items} probe items ({'cached' if self.cached else 'measured'}; "
                f"{weights}; η at the items' {self.quantile:g} quantile): {need}")


def envelope_path(fingerprint: str) -> Path:
    """Where the envelope of the model with ``fingerprint`` is cached."""
    return _proof_dir() / f"envelope-v{ENVELOPE_VERSION}-{fingerprint[:40]}.json"


_ENVELOPES: dict[str, FidelityEnvelope] = {}


def load_envelope(fingerprint: str) -> FidelityEnvelope | None:
    """The cached envelope of this model (None when it was never calibrated, or the cached file
    does not parse: calibrate again)."""
    if fingerprint in _ENVELOPES:
        return _ENVELOPES[fingerprint]
    if not _DISK[-1]:
        return None
    try:
        data = json.loads(envelope_path(fingerprint).read_text())
        for k in ("energies", "median_eta", "p10_eta", "mean_bytes_fraction", "items", "sensitivity_k", "sensitivity_v"):
            data[k] = tuple(data.get(k, ()))
        data["item_eta"] = tuple(tuple(row) for row in data.get("item_eta", ()))
        data["cached"] = True
        env = FidelityEnvelope(**data)
    except (OSError, ValueError, TypeError, KeyError, EnvelopeError):
        return None
    if env.fingerprint != fingerprint or env.version != ENVELOPE_VERSION:
        return None
    _ENVELOPES[fingerprint] = env
    return env


def save_envelope(env: FidelityEnvelope) -> Path | None:
    """Cache ``env`` (atomically; in memory only inside ``detect.memory_only()``). Returns the
    file written, or None when only the memory cache holds it (read-only cache dir included)."""
    _ENVELOPES[env.fingerprint] = env
    if not _DISK[-1]:
        return None
    path = envelope_path(env.fingerprint)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
        data = {k: v for k, v in env.as_dict().items() if k != "cached"}
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def forget_envelope(fingerprint: str) -> None:
    """Drop the in-memory copy (the next :func:`load_envelope` reads the disk again)."""
    _ENVELOPES.pop(fingerprint, None)
