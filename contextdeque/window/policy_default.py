"""The eager patch policy: patch on append at rank m; survivors keep their KV as-is.

Every decision that needs a patch forms it before the operation returns (see ``policy_latency``
for the variant that defers that work to ``heal``).

- ``append``: an exact patch at rank m on the antecedents in front of the chunk.
- ``recall``: a *fresh* recall patch at rank m on the chunk's new antecedents (never the patch
  frozen at eviction: it goes stale as the window turns over).
- ``survivor`` (slide / mid-window eviction): keep the conditioned KV, relocate only; with
  ``survivor_staleness=s``, a survivor whose :func:`staleness <.staleness.staleness>` exceeds
  ``s`` (much of what it was conditioned on left or changed) gets a fresh exact patch at rank m
  on what now precedes it instead (measured on the default model, the doc demo's first question
  at rank 32: its two survivors, staleness 1.0 and 0.72, kept as-is gave next-token KL 0.0154 at
  answer time, re-conditioned 0.0043; the recalled page's own patch changed nothing; the agents
  use ``SURVIVOR_STALENESS``). With ``removal_rank=r`` a survivor instead stacks a rank-r
  removal patch (for backbones where the departed antecedent's absorbed influence matters, e.g.
  deepstack). A survivor left at the front (every antecedent gone) drops its patches: its
  canonical is exact there, for free.
- ``reorder``: an orbit patch for the new antecedent set where the store has one; otherwise,
  for a pure permutation of the antecedents the slot was conditioned on (at most
  ``orbit_max_antecedents`` of them), form one (one forward per ordering: every later ordering
  of that set is then free); for a changed set, a fresh exact patch at rank m.
  ``reorder="exact"`` always forms an exact patch; ``reorder="keep"`` transfers the current one.
- ``inserted`` (a recall landed in front): a valid stored exact patch on the new prefix where the
  store has one (a hit, no forward), else keep; ``refresh_inserted=True`` forms one.
- ``cascade`` / ``refresh``: a fresh exact patch at rank m on the current antecedents.
A slot with nothing in front of it is exactly its canonical, so appends/recalls/reorders there
carry no patch, and survivors that reach the front drop theirs.
"""

from __future__ import annotations

from typing import Sequence

from ..core.errors import WindowError
from .policy import CLEAR, KEEP, Decision, PatchPolicy, form
from .slot import Slot
from .staleness import staleness


ORBIT_MAX_ANTECEDENTS = 4  # a reorder forms an orbit patch for a set of at most this many antecedents
ORBIT_MAX_ORDERINGS = 24  # conditioned forwards one orbit patch averages at most
SURVIVOR_STALENESS = 0.5  # survivor_staleness where survivors are re-conditioned (the agents'; see the module doc)


class DefaultPolicy(PatchPolicy):
    name = "eager"

    def __init__(
        self,
        *,
        removal_rank: int | None = None,
        reorder: str = "orbit",
        orbit_max_antecedents: int = ORBIT_MAX_ANTECEDENTS,
        max_orderings: int = ORBIT_MAX_ORDERINGS,
        refresh_inserted: bool = False,
        survivor_staleness: float | None = None,
    ) -> None:
        if reorder not in ("orbit", "exact", "keep"):
            raise WindowError(f"reorder must be 'orbit', 'exact' or 'keep', got {reorder!r}")
        self.removal_rank = removal_rank
        self.reorder = reorder
        self.orbit_max_antecedents = int(orbit_max_antecedents)
        self.max_orderings = int(max_orderings)
        self.refresh_inserted = bool(refresh_inserted)
        if survivor_staleness is not None and not 0.0 <= float(survivor_staleness) <= 1.0:
            raise WindowError(f"survivor_staleness must be within [0, 1] or None, got {survivor_staleness!r}")
        self.survivor_staleness = None if survivor_staleness is None else float(survivor_staleness)

    def decide(self, reason: str | None, slot: Slot, prefix: Sequence[Slot], *, valid: bool, rank: int) -> Decision:
        if reason is None:
            return KEEP
        if not prefix:
            # Nothing in front: the canonical is exact and costs no forward. A survivor that slid
            # to the front keeps no patch formed for antecedents that all left (measured on the
            # default model: keeping it made the demo's first question's KL 0.164, clearing 0.024).
            return CLEAR if slot.stack else KEEP
        if reason == "append":
            return form("exact", rank)
        if reason == "recall":
            return form("recall", rank)
        if reason in ("cascade", "refresh"):
            return form("exact", rank)
        if reason == "survivor":
            if self.removal_rank:
                return form("removal", int(self.removal_rank), stack=True)
            if self.survivor_staleness is not None and staleness(slot, prefix) > self.survivor_staleness:
                return form("exact", rank)
            return KEEP
        if reason == "inserted":
            if valid:  # its conditioning is exactly what precedes it again (a look-back put back)
                return KEEP
            if self.refresh_inserted:
                return form("exact", rank)
            # a valid stored patch on its new prefix where the store has one (no forward: as if it
            # had been appended there, e.g. behind a look-back put back where it stood), else keep
            return form("exact", rank, reuse_only=True, fallback=KEEP)
        if reason == "reorder":
            if valid or self.reorder == "keep":
                return KEEP
            if self.reorder == "exact":
                return form("exact", rank)
            opts = {"max_orderings": self.max_orderings}
            carried = sorted(a.chunk_id for a, _ in slot.conditioned_on)
            now = sorted(s.chunk.id for s in prefix)
            if carried == now and len(prefix) <= self.orbit_max_antecedents:
                fallback = form("orbit", rank, options=opts)
            else:
                fallback = form("exact", rank)
            return form("orbit", rank, reuse_only=True, fallback=fallback, options=opts)
        return KEEP

    def __repr__(self) -> str:
        return (
            f"DefaultPolicy(removal_rank={self.removal_rank}, reorder={self.reorder!r}, "
            f"orbit_max_antecedents={self.orbit_max_antecedents}, survivor_staleness={self.survivor_staleness})"
        )
