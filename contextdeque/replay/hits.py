"""The anticipation hit rate: per step type, the share of a trace's re-read steps that a real
window answered fresh with 0 forwards on the critical path (``Receipt.answered_fresh``: every
chunk given conditioning got a valid stored, anticipated, orbit or recurring patch; nothing was
served stale or blind, no forward ran), read off the receipts of ``replay.live.drive_window``.

Two readings: **strict** (every chunk the step gave conditioning was fresh) and **own** (the
chunks the step itself brought back or moved were fresh, 0 forwards; the recall cascade's
dependents, which a latency-first window keeps as they stood and queues for ``heal``, aside).

Re-read steps are the ones that put content the window already saw somewhere its conditioning
must follow: ``slide``, ``recall`` (at the end), ``look-back`` (a recall inside the window) and
``reorder`` (:data:`RE_READS`, the headline rate). ``evict``, ``commit`` and ``discard`` are
counted too (survivors relocate; a chunk left at the front needs its canonical) but reported
apart: they are covered without anticipation almost always. Appends of new content are never
re-reads (new content needs its forward).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

from ..window.receipt import DEFERRED_SERVED, Receipt

RE_READS = ("slide", "recall", "look-back", "reorder")
"""Step types the headline hit rate covers."""

COUNTED = RE_READS + ("evict", "commit", "discard")
"""Every step type counted (the others are reported per type only)."""


class HitRate:
    """Counts re-read steps and the ones answered fresh with 0 forwards, per step type."""

    def __init__(self) -> None:
        self.steps: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()
        self.own_hits: Counter[str] = Counter()

    def add(self, step: str, receipt: Receipt) -> None:
        """One step of type ``step`` and its receipt (the step's window operations summed)."""
        if step not in COUNTED:
            return
        self.steps[step] += 1
        self.hits[step] += int(receipt.answered_fresh)
        own = set(receipt.refs)
        self.own_hits[step] += int(receipt.forwards == 0 and not any(
            what in DEFERRED_SERVED for ref, what in receipt.served if ref in own))

    def rate(self, types: Iterable[str] = RE_READS, *, own: bool = False) -> float | None:
        """Hits (``own``: of the step's own chunks) over steps of ``types`` (None: no such step ran)."""
        types = tuple(types)
        n = sum(self.steps[t] for t in types)
        hits = self.own_hits if own else self.hits
        return None if n == 0 else sum(hits[t] for t in types) / n

    def by_step(self) -> dict[str, dict[str, Any]]:
        """``step -> {"steps", "hits", "rate", "own_hits", "own_rate"}`` for every type that ran."""
        return {t: {"steps": self.steps[t], "hits": self.hits[t], "rate": self.hits[t] / self.steps[t],
                    "own_hits": self.own_hits[t], "own_rate": self.own_hits[t] / self.steps[t]}
                for t in COUNTED if self.steps[t]}

    def as_dict(self) -> dict[str, Any]:
        """The per-type table and the headline rates over :data:`RE_READS` (JSON-friendly)."""
        return {"by_step": self.by_step(), "re_reads": sum(self.steps[t] for t in RE_READS),
                "re_read_hits": sum(self.hits[t] for t in RE_READS), "hit_rate": self.rate(),
                "own_hit_rate": self.rate(own=True)}
