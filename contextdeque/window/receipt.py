"""Receipts: what every window operation cost (forwards, tokens, bytes per tier, wall time)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.counters import OMIT, Counters, adds, shown
from ..patch.alloc import fidelity_report
from ..stores import TierTraffic
from .plan import Op, Plan

if TYPE_CHECKING:  # pragma: no cover
    from .context import WindowContext
    from .budget import BudgetReport
    from .graph import Cascade
    from .ref import ChunkRef

PAGES = "pages"
"""Key of ``Receipt.bytes_moved`` for conditioned-KV bytes written into the window's pages."""


@dataclass(frozen=True)
class LoadFallback:
    """A chunk whose stored canonical could not be loaded (``tier``, ``error``: exception type and
    message) and was recomputed instead (one encode)."""

    chunk_id: str
    tier: str | None
    error: str

    def as_dict(self) -> dict[str, Any]:
        return {"chunk_id": self.chunk_id, "tier": self.tier, "error": self.error}


DEFERRED_SERVED = ("stale", "blind", "conditioned")
"""What a latency-first policy serves a chunk it defers (``Receipt.served``): not fresh."""
PREPARED_SERVED = ("anticipated", "recurring", "orbit")
"""What ``Receipt.served`` says of a valid patch the store held before the step: formed by
anticipation in idle time, or earlier for this arrangement (recurring) or its set (orbit)."""


@dataclass(frozen=True)
class FidelityMiss:
    """A chunk whose patch falls short of the window's ``fidelity_target`` (the byte cap could not
    fit it and ``on_miss="report"``), or that met it only past the cap (``exceeded-budget``,
    ``recomputed``): ``action`` says which (see ``contextdeque.patch.alloc.ON_MISS``).

    ``eta_est``: η the model's calibrated envelope expects of the patch (None when the model has
    no envelope: then ``energy`` against ``energy_target`` is the measure); ``patch_bytes`` /
    ``budget_bytes``: what the patch holds and what the cap allowed."""

    ref: "ChunkRef"
    chunk_id: str
    eta_target: float | None
    eta_est: float | None
    energy_target: float
    energy: float
    patch_bytes: int
    budget_bytes: int | None
    action: str

    @property
    def missed(self) -> bool:
        """The patch the window holds falls short of the target."""
        return self.action == "reported"

    def as_dict(self) -> dict[str, Any]:
        return {"ref": self.ref.key, "chunk_id": self.chunk_id, "eta_target": self.eta_target, "eta_est": self.eta_est,
                "energy_target": self.energy_target, "energy": self.energy, "patch_bytes": self.patch_bytes,
                "budget_bytes": self.budget_bytes, "action": self.action}

    def describe(self) -> str:
        est = f"η≈{self.eta_est:.3f}" if self.eta_est is not None else f"energy {self.energy:.3f}"
        want = f"η {self.eta_target:g}" if self.eta_est is not None else f"energy {self.energy_target:.3f}"
        cap = "-" if self.budget_bytes is None else f"{self.budget_bytes / 1024:.0f}KiB"
        return f"#{self.ref.key}: {est} for {want} ({self.action}; {self.patch_bytes / 1024:.0f}KiB, cap {cap})"


def _keys(refs: Any) -> list[int]:
    return [r.key for r in refs]


@dataclass
class Receipt(Counters):
    """The cost of one window operation.

    Attributes:
        op: operation name (``append``, ``slide``, ``reorder``, ``evict``, ``recall``, ``fork``,
            ``commit``, ``discard``, ``purge``, ``refresh``, ``materialize``, ``generate``,
            ``is_disposable``).
        forwards, tokens_prefilled, encodes, patches_formed, patches_reused: the counts every
            record shares (:class:`~contextdeque.core.counters.Counters`): model forwards run
            (chunk encodes, conditioned forwards forming patches, decode steps), the tokens they
            processed, chunks encoded (a forward over a chunk never seen by the store),
            conditioning patches formed by a forward, patches served by the store instead.
        pages_written: slots whose placed, conditioned KV was (re)computed (relocation + patch).
        bytes_moved: tier name -> bytes read plus written in the store by this operation, and
            ``"pages"`` -> bytes of conditioned KV written into the window's pages (or into
            the materialized cache).
        wall_ms: wall-clock time of the operation.
        refs: the refs the operation acted on (appended, recalled, evicted, slid...).
        left: refs that left the window (slid out, evicted, or pushed out by the budget).
        cascade: for ``recall``, the conditioning cascade it implied (see ``graph.Cascade``).
        deferred: chunks a latency-first policy answered without the conditioning the eager
            policy would have formed, as ``(ref, served, staleness)``: ``served`` is ``"stale"``
            (its previous patch), ``"blind"`` (its canonical) or ``"conditioned"`` (new content's
            own conditioned forward, canonical not computed yet); they are queued for ``heal``.
        traffic: the store's detailed per-tier record (reads, writes, evictions, hits, drops,
            and ``fallbacks``: operations a remote tier could not serve because it was away).
        notes: free-form remarks (e.g. which patch kind each slot got).
        load_fallbacks: chunks whose stored canonical failed to load (corrupt, unreadable, ...)
            and were recomputed instead (``extend``).
        loading: for ``extend``, how loads and the model's work overlapped (seconds spent
            loading, computing, waiting on loads; loads by tier; ``overlapped`` or not).
        repairs: what the operation repaired: store copies that failed verification and were
            quarantined, and the canonicals / patches rebuilt from their source in their place.
        served: per chunk given conditioning (or deferred), ``(ref, what)``: ``"fresh"`` (a
            patch formed now), ``"recurring"`` / ``"orbit"`` (a valid stored exact / orbit patch,
            ``reconcile.served_label``), ``"anticipated"`` (a valid
            patch anticipation formed in idle time, ``window.anticipation``), ``"stale"`` /
            ``"blind"`` / ``"conditioned"`` (deferred: as in ``deferred``).
        fidelity_misses: chunks (re)conditioned by this operation whose patch the byte cap could
            not fit ``fidelity_target`` into, and what ``on_miss`` did (:class:`FidelityMiss`).
        placed: for ``recall``, ``(ref, index, why)``: where the chunk went and why (``"asked"``:
            the agent pinned it; else what the window's choice found there, e.g. ``"front:
            canonical exact"``, ``"behind its stored patch's antecedents"``, ``"end"``).
        budget: under ``answer_kl_budget``, what the fidelity floor estimated per chunk (served,
            deficit, estimated KL), for the arrangement, and what it formed
            (:class:`~.budget.BudgetReport`); None without a budget.
        plan: the operations the window executed, key-only (``window.plan``: encodes, forwards,
            patches formed or reused, keeps and clears, with their inputs and stored bytes), the
            same record the offline replay prices.
    """

    op: str
    pages_written: int = adds()
    bytes_moved: dict[str, int] = adds(dict)
    wall_ms: float = adds(0.0, json=lambda v: round(v, 3))
    refs: tuple["ChunkRef", ...] = adds((), json=_keys)
    left: tuple["ChunkRef", ...] = shown(_keys, default=())
    cascade: "Cascade | None" = shown()
    deferred: tuple[tuple["ChunkRef", str, float], ...] = shown(
        lambda d: [[r.key, served, round(s, 4)] for r, served, s in d], default=())
    traffic: TierTraffic = shown(lambda t: dict(t.fallbacks), name="fallbacks", factory=TierTraffic, repr=False)
    notes: tuple[str, ...] = adds(())
    load_fallbacks: tuple[LoadFallback, ...] = shown(default=())
    loading: dict[str, Any] | None = shown()
    repairs: tuple[str, ...] = adds(())
    served: tuple[tuple["ChunkRef", str], ...] = adds((), json=lambda s: [[r.key, what] for r, what in s])
    fidelity_misses: tuple[FidelityMiss, ...] = adds(())
    placed: tuple[tuple["ChunkRef", int, str], ...] = adds((), json=lambda p: [[r.key, i, why] for r, i, why in p])
    budget: "BudgetReport | None" = shown()
    plan: tuple[Op, ...] = adds((), json=OMIT, repr=False)  # (window.plan: the replay prices it; not written)

    @classmethod
    def merged(cls, op: str, receipts: "list[Receipt]", wall_ms: float | None = None) -> "Receipt":
        """One receipt summing ``receipts`` (e.g. the steps of a heal): their added fields."""
        out = cls.summed(receipts, op=op)
        if wall_ms is not None:
            out.wall_ms = wall_ms
        return out

    def __repr__(self) -> str:
        return f"Receipt({self.summary()})"

    @property
    def total_bytes_moved(self) -> int:
        return sum(self.bytes_moved.values())

    @property
    def answered_fresh(self) -> bool:
        """0 forwards, and every chunk given conditioning got a valid one (``served``: a stored,
        anticipated, orbit or recurring patch; nothing stale, blind or waiting for its canonical):
        a re-read that anticipation (or the store) covered."""
        return self.forwards == 0 and not self.deferred and all(what not in DEFERRED_SERVED for _, what in self.served)

    def summary(self) -> str:
        """One line for logs and examples."""
        moved = ", ".join(f"{k}={v / 1024:.1f}KiB" for k, v in sorted(self.bytes_moved.items()) if v) or "0 B"
        extra = ""
        if self.cascade is not None and self.cascade.implied:
            extra = f", cascade {len(self.cascade.implied)} ({self.cascade.action})"
        if self.deferred:
            extra += f", {len(self.deferred)} deferred"
        if self.repairs:
            extra += f", {len(self.repairs)} repair(s)"
        missed = sum(1 for m in self.fidelity_misses if m.missed)
        if missed:
            extra += f", {missed} fidelity miss(es)"
        if len(self.fidelity_misses) > missed:
            extra += f", {len(self.fidelity_misses) - missed} over the patch byte cap"
        return (
            f"{self.op}: {self.forwards} fwd, {self.tokens_prefilled} tok prefilled, {self.encodes} enc, "
            f"patches {self.patches_formed} formed/{self.patches_reused} reused, {self.pages_written} pages, "
            f"moved {moved}, {self.wall_ms:.1f} ms{extra}"
        )


ADDED_FIELDS = tuple(f.name for f in dataclasses.fields(Receipt) if f.metadata.get("adds"))  # what ``+`` sums


class Meter:
    """Measures one operation: snapshots the counters at start, produces a Receipt at the end."""

    def __init__(self, ctx: "WindowContext", op: str) -> None:
        self.ctx = ctx
        self.op = op
        self.traffic = TierTraffic()
        self.patches_formed = 0
        self.patches_reused = 0
        self.pages_written = 0
        self.page_bytes = 0
        self.notes: list[str] = []
        # latency-first bookkeeping: ref -> (reason, served, staleness); refs given new conditioning
        self.deferred: dict["ChunkRef", tuple[str | None, str, float]] = {}
        self.reconditioned: set["ChunkRef"] = set()
        # deferred ref -> the antecedents its conditioning carried before the deferral
        self.carried: dict["ChunkRef", tuple] = {}
        # ref -> the conditioning a chunk given new conditioning (or a deferred one) was served:
        # "fresh" (formed now), "recurring" / "orbit" / "anticipated" (a valid stored patch; anticipated: formed
        # ahead in idle time, window.anticipation), "stale" / "blind" / "conditioned" (deferred)
        self.served: dict["ChunkRef", str] = {}
        self.formed_keys: list[str] = []  # store keys of the patches formed (anticipation remembers its own)
        self.repairs: list[str] = []  # rebuilt from source (quarantines come from the traffic)
        self.fidelity_misses: list[FidelityMiss] = []
        self.plan = Plan()  # what this operation executed (window.plan)
        self._fw0 = ctx.total_forwards()
        self._tok0 = ctx.total_tokens()
        self._enc0 = ctx.counters.encodes
        self._t0 = time.perf_counter()

    def page(self, nbytes: int) -> None:
        self.pages_written += 1
        self.page_bytes += int(nbytes)

    def note_fidelity(self, slot: Any, patch: Any) -> None:
        """Record ``slot``'s patch if the fidelity rule could not meet its target within the cap."""
        rep = fidelity_report(patch)
        if rep is None or not rep.get("shortfall"):
            return
        self.fidelity_misses.append(FidelityMiss(
            ref=slot.ref, chunk_id=slot.chunk.id, eta_target=rep.get("eta_target"), eta_est=rep.get("eta_est"),
            energy_target=float(rep["energy_target"]), energy=float(rep["energy"]), patch_bytes=int(patch.nbytes),
            budget_bytes=rep.get("budget_bytes"), action=str(rep["action"])))

    def finish(self, **fields: Any) -> Receipt:
        moved: dict[str, int] = {}
        for d in (self.traffic.read, self.traffic.written):
            for k, v in d.items():
                moved[k] = moved.get(k, 0) + v
        if self.page_bytes:
            moved[PAGES] = self.page_bytes
        for tier, n in sorted(self.traffic.fallbacks.items()):
            reason = self.traffic.fallback_reasons.get(tier, "away")
            self.notes.append(f"store tier {tier!r} away ({reason}): {n} store op(s) fell back to the local tiers")
        return Receipt(
            op=self.op,
            forwards=self.ctx.total_forwards() - self._fw0,
            tokens_prefilled=self.ctx.total_tokens() - self._tok0,
            encodes=self.ctx.counters.encodes - self._enc0,
            patches_formed=self.patches_formed,
            patches_reused=self.patches_reused,
            pages_written=self.pages_written,
            bytes_moved=moved,
            wall_ms=(time.perf_counter() - self._t0) * 1000.0,
            traffic=self.traffic,
            notes=tuple(self.notes),
            deferred=tuple((r, served, s) for r, (_, served, s) in self.deferred.items()),
            served=tuple(self.served.items()),
            repairs=tuple(
                [f"quarantined a corrupt copy of {q.split(':', 1)[1][:40]} in tier {q.split(':', 1)[0]!r}"
                 for q in self.traffic.quarantined] + self.repairs
            ),
            fidelity_misses=tuple(self.fidelity_misses),
            plan=tuple(self.plan),
            **fields,
        )
