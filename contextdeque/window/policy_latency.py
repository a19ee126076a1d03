"""The latency-first patch policy: no forward on the critical path of a re-read.

It wraps an eager policy (``"eager"`` by default, or ``"exact"``) and asks it what each slot
should get. Where the eager answer is "form a patch", it serves the best patch the store
already has instead, in this order:

1. the patch the eager policy asked for, if the store holds it (valid: same antecedents);
2. for a pure permutation, an orbit patch of the prefix's chunk set from the store (valid for
   every ordering of that set);
3. the slot's own, now stale, conditioning if its :func:`staleness <.staleness.staleness>` is
   within ``staleness_budget``;
4. the blind canonical (relocation only).

and queues the slot: ``ContextWindow.heal`` (or the idle healer) later carries out the eager
policy's decision on the window as it then stands, transactionally. After a full heal the
window holds what the eager policy would have built for it, except that content with no
canonical yet holds its exact conditioned KV where the eager policy holds canonical + patch.
New content still needs its forward; re-reads (slide, evict, recall, look-back, reorder, fork
edits) run none, but for the recall of a chunk that left before anything needed its canonical.

New content costs what a prefix cache's append costs: one forward of its tokens after the
window (a *provisional* slot holding ``KV(B | window)``). Its canonical ``KV(B | root)`` waits
until something needs it: a chunk read once, or kept where it was read (a survivor keeps its KV
as the eager policy's survivors keep theirs), never costs a second forward. Healing leaves a
provisional slot as it is; re-conditions it, where the eager policy would form a patch (it was
moved, re-read or its antecedent recalled), by one conditioned forward behind its new prefix
(what forming a patch costs, and exact); and computes its canonical only when it reaches the
front, where the canonical is exact. A provisional chunk evicted is recalled the same way: one
conditioned forward where it re-enters.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

from ..core.errors import WindowError
from .policy import CLEAR, KEEP, PATCH_POLICIES, Decision, PatchPolicy, make_policy
from .ref import ChunkRef
from .slot import Slot, Tag
from .staleness import staleness

DEFAULT_STALENESS_BUDGET = 0.5


class LatencyPolicy(PatchPolicy):
    """Latency-first wrapper around an eager ``inner`` policy (a registered name or instance).

    ``staleness_budget``: the largest staleness at which a slot keeps its stale patch rather than
    falling back to its blind canonical while it waits to be healed (0: never serve stale).
    """

    name = "latency"

    def __init__(self, inner: "str | PatchPolicy" = "eager", *, staleness_budget: float = DEFAULT_STALENESS_BUDGET, **inner_options: Any) -> None:
        if isinstance(inner, str) and inner_options:
            if inner not in PATCH_POLICIES:
                raise WindowError(f"unknown patch policy {inner!r}; registered: {sorted(PATCH_POLICIES)}")
            inner = PATCH_POLICIES[inner](**inner_options)
        self.inner = make_policy(inner)
        if isinstance(self.inner, LatencyPolicy):
            raise WindowError("a latency-first policy wraps an eager policy, not another latency-first one")
        budget = float(staleness_budget)
        if not 0.0 <= budget <= 1.0:
            raise WindowError(f"staleness_budget must be within [0, 1], got {staleness_budget!r}")
        self.staleness_budget = budget
        # Patches formed while healing are the inner policy's: share its store namespace.
        self.regime = self.inner.regime

    @property
    def eager(self) -> PatchPolicy:
        """The policy ``heal`` carries out."""
        return self.inner

    defers_canonical = True
    lazy_canonicals = True  # (``latency-shared``: every canonical while healing)

    def decide(self, reason: str | None, slot: Slot, prefix: Sequence[Slot], *, valid: bool, rank: int) -> Decision:
        wanted = self.inner.decide(reason, slot, prefix, valid=valid, rank=rank)
        if slot.provisional:  # no canonical yet: it keeps its conditioned KV until healed
            if reason is not None and not prefix:  # at the front the canonical is exact: heal computes it
                return replace(KEEP, deferred=True)
            return KEEP if wanted.action == "keep" or _never_forms(wanted) else replace(KEEP, deferred=True)
        if wanted.action != "form" or _never_forms(wanted):
            return wanted  # (a store lookup that falls back to keep/clear runs no forward either)
        return _store_only(wanted, self._stand_in(reason, slot, prefix, wanted))

    def _stand_in(self, reason: str | None, slot: Slot, prefix: Sequence[Slot], wanted: Decision) -> Decision:
        """What the slot gets now when the store has no valid patch for it."""
        if wanted.stack or reason == "survivor":  # a correction, or a survivor's refresh: keep what it carries meanwhile
            return replace(KEEP, deferred=True)
        if slot.stack and staleness(slot, prefix) <= self.staleness_budget:
            return replace(KEEP, deferred=True)
        return replace(CLEAR if slot.stack else KEEP, deferred=True)

    def describe(self) -> str:
        return f"latency({self.inner.describe()})"

    def __repr__(self) -> str:
        return f"LatencyPolicy(inner={self.inner!r}, staleness_budget={self.staleness_budget})"


class HealPolicy(PatchPolicy):
    """What a heal step carries out: the eager policy's decisions, except for provisional slots
    (they have no canonical: ``ContextWindow.heal`` keeps or re-forwards them, and computes the
    canonical only at the front). Not registered: built by ``ContextWindow.heal``.

    ``carried``: for each slot healed, the antecedents its conditioning carried before it was
    deferred. The eager policy decides on the slot as it was then: a blind stand-in (its stale
    patch dropped meanwhile) must get the patch the eager policy would have formed for the slot
    it had, e.g. an orbit patch for a pure permutation rather than a fresh exact one."""

    def __init__(self, eager: PatchPolicy, carried: Mapping[ChunkRef, tuple[Tag, ...]] | None = None) -> None:
        self.eager = eager
        self.regime = eager.regime
        self.carried = dict(carried or {})

    def decide(self, reason: str | None, slot: Slot, prefix: Sequence[Slot], *, valid: bool, rank: int) -> Decision:
        if slot.provisional:
            return KEEP
        tags = self.carried.get(slot.ref)
        # What it carried is stale on this prefix: the eager policy's answer for that slot. (When
        # it is valid again, the slot no longer holds it: decide on the slot as it is.)
        if tags is not None and tags != slot.conditioned_on and tags != tuple((s.ref, s.version) for s in prefix):
            slot = _as_conditioned_on(slot, tags)
            valid = False
        return self.eager.decide(reason, slot, prefix, valid=valid, rank=rank)


def _as_conditioned_on(slot: Slot, tags: tuple[Tag, ...]) -> Slot:
    """A view of ``slot`` (for a policy's decision only) whose ``conditioned_on`` is ``tags``."""
    view = Slot(ref=slot.ref, chunk=slot.chunk, stack=slot.stack, start=slot.start, stale=slot.stale)
    view.__dict__["conditioned_on"] = tags  # the cached property's slot: a frozen record otherwise
    return view


def _never_forms(decision: Decision) -> bool:
    """Whether ``decision`` runs no forward whatever the store holds: every ``form`` in its fallback
    chain is ``reuse_only`` and the chain ends in keep or clear."""
    d: Decision | None = decision
    while d is not None and d.action == "form":
        if not d.reuse_only:
            return False
        d = d.fallback
    return True


def _store_only(decision: Decision, last: Decision) -> Decision:
    """``decision`` and its fallbacks as store lookups only, then an orbit patch of the same
    prefix set, then ``last``."""
    chain: list[Decision] = []
    d: Decision | None = decision
    while d is not None and d.action == "form":
        chain.append(d)
        d = d.fallback
    if not any(c.kind == "orbit" for c in chain) and not decision.stack:
        chain.append(Decision("form", kind="orbit", rank=decision.rank, options=decision.options))
    out = last
    for c in reversed(chain):
        out = replace(c, reuse_only=True, fallback=out)
    return out
