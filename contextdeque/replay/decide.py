"""The replay's window decides with the window's own patch policy: key-only slots
(``window.plan.KeySlot``) handed to ``PatchPolicy.decide``, and the decision priced as
``window.reconcile`` carries it out (a mixin of :class:`~.engine.Replayer`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..patch import PATCH_KINDS
from ..window.plan import ChunkKeys, KeySlot, KeySlots
from ..window.policy import KEEP, Decision
from ..window.ref import ChunkRef

if TYPE_CHECKING:  # pragma: no cover
    from ..window.graph import PatchGraph
    from ..window.policy import PatchPolicy


class PolicyDecisions:
    """Needs the replay's ``formed`` / ``content`` / ``tokens`` / ``graph`` / ``rank``, its
    ``_form`` / ``_set_formed``, the policy the window runs (``eager``: a latency-first one's eager
    policy, whose decisions the replay defers as the window does), ``_refs`` and ``_key_slots``."""

    formed: dict[str, tuple[str, ...]]
    content: dict[str, str]
    tokens: dict[str, int]
    graph: "PatchGraph"
    rank: int
    eager: "PatchPolicy"
    _refs: "Refs"
    _key_slots: dict[str, tuple[tuple[str, ...], KeySlot]]

    def key_slot(self, key: str) -> KeySlot:
        """``key`` as the window's patch policy sees a slot, keys only (one object per key and
        conditioning: a slot is looked at far more often than its conditioning changes)."""
        formed = self.formed.get(key, ())
        cached = self._key_slots.get(key)
        if cached is not None and cached[0] is formed:
            return cached[1]
        refs = self._refs
        slot = KeySlot(refs[key], ChunkKeys(self.content[key], self.tokens[key]),
                       (lambda: [(refs[a], "") for a in formed]) if formed else (), ("patch",) if formed else ())
        self._key_slots[key] = (formed, slot)
        return slot

    def decide(self, reason: str, key: str, prefix: Sequence[str], stop: int | None = None) -> Decision:
        """The window's own (eager) patch policy's decision for ``key`` behind ``prefix`` (its
        first ``stop`` keys, when given: no copy of the window's order per survivor)."""
        if self._simulating and key in self.pending.uncanonical:
            return KEEP  # anticipation keeps a provisional slot as it is (``HealPolicy``)
        n = len(prefix) if stop is None else stop
        valid = self.valid(key, prefix, n)
        return self.eager.decide(reason, self.key_slot(key), KeySlots(prefix, self.key_slot, n), valid=valid, rank=self.rank)

    def valid(self, key: str, prefix: Sequence[str], stop: int | None = None) -> bool:
        """Whether ``key``'s conditioning was formed on exactly ``prefix[:stop]`` *in their current
        KV states* (the window compares ``(ref, version)`` tags: an antecedent re-conditioned
        since makes it stale)."""
        formed = self.formed.get(key, ())
        n = len(prefix) if stop is None else stop
        return len(formed) == n and tuple(prefix[:n]) == formed and self._formed_states.get(key, ()) == tuple(
            map(self._kv_state, formed))

    def carry_out(self, key: str, prefix: Sequence[str], decision: Decision, ctx: int | None = None, reason: str | None = None) -> str:
        """Price ``decision`` for ``key`` behind ``prefix`` as ``reconcile.execute`` carries it out:
        a ``form`` is a store hit or one formed patch (a ``reuse_only`` one falls back when the
        store has none); returns the action taken (``keep`` / ``clear`` / ``form``)."""
        d: Decision | None = decision
        while d is not None and d.action == "form":
            if d.reuse_only and not self._stored(key, prefix, d.kind):
                d = d.fallback
                continue
            self._form(key, prefix, d.kind, ctx=ctx, max_orderings=dict(d.options).get("max_orderings", 1), reason=reason)
            return "form"
        if d is not None and d.action == "clear" and self.formed.get(key):
            self._set_formed(key, ())
            return "clear"
        return "keep"

    def _stored(self, key: str, prefix: Sequence[str], kind: str | None) -> bool:
        """Whether the store holds a valid ``kind`` patch of ``key``'s content on ``prefix``: keyed
        as the window keys it, by the antecedents' KV states (``Replayer._is_stored``)."""
        if kind != "orbit" and not PATCH_KINDS[kind].exact_on_prefix:
            return False
        return self._is_stored(key, prefix, kind)


class Refs(dict):
    """Trace chunk id -> a ``ChunkRef`` standing for it in key-only slots (made when first asked)."""

    def __init__(self, content: dict[str, str], tokens: dict[str, int]) -> None:
        super().__init__()
        self._content, self._tokens = content, tokens

    def __missing__(self, key: str) -> ChunkRef:
        ref = self[key] = ChunkRef(key=len(self), chunk_id=self._content[key], n_tokens=self._tokens[key])
        return ref
