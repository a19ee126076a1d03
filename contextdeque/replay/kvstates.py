"""The replay's mirror of the live window's KV states (``window.kvstate``).

The window's patch keys name the antecedents' KV states, so a stored patch serves only behind the
very states it was formed on. The replay mirrors that over keys: each key's state (absent: its
canonical), the states its conditioning was formed on, and the patches stored as (content, kind,
antecedent states). A mixin of :class:`~.engine.Replayer`, which owns the dictionaries it reads
(``formed``, ``content``, ``tokens``, ``_state``, ``_formed_states``, ``_stored_patches``, ...).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

from ..patch.keys import kv_state
from ..window.policy_latency import DEFAULT_STALENESS_BUDGET
from ..window.staleness import staleness_score


@functools.lru_cache(maxsize=1 << 16)
def canonical_state(content: str) -> str:
    """The KV state of ``content``'s canonical (``kv_state(content)``; cached: the replay names a
    prefix's states at every decision, and a canonical's name never changes)."""
    return kv_state(content)


class KVStateMirror:
    """KV-state bookkeeping of the replay (see the module docstring)."""

    def _init_kv_states(self) -> None:
        self._state: dict[str, str] = {}  # key -> its KV state (absent: its canonical)
        self._formed_states: dict[str, tuple[str, ...]] = {}  # key -> the states it was formed on
        self._stored_patches: set[tuple[str, str, Any]] = set()  # (content, kind, antecedent states)

    def _stand_in(self, key: str, prefix: Sequence[str]) -> None:
        """What a deferred slot serves meanwhile (``LatencyPolicy._stand_in``): its stale patch
        within the staleness budget, else its blind canonical (its state then: the canonical)."""
        formed, states = self.formed.get(key, ()), self._formed_states.get(key)
        if key in self._entering and formed and not self.pending.unencoded(key):
            self._set_formed(key, ())  # (it enters as its canonical: no patch to keep meanwhile)
            return
        if not formed or states is None or self.pending.unencoded(key):
            return
        tok = self.tokens.__getitem__
        score = staleness_score([((a, st), tok(a)) for a, st in zip(formed, states)],
                                [((p, self._kv_state(p)), tok(p)) for p in prefix])
        if score > DEFAULT_STALENESS_BUDGET:
            self._state.pop(key, None)
            self._formed_states[key] = ("blind",)  # (never settled: its prefix is not empty)
            self.pool.condition(key, None)  # (its slot lets go of the patch: it serves its canonical)

    def _kv_state(self, key: str) -> str:
        return self._state.get(key) or canonical_state(self.content[key])

    def _antecedent_states(self, prefix: Sequence[str], kind: str) -> Any:
        """What a patch key names ``prefix`` by (``window.kvstate.antecedent_states``): the states in
        order, or for an orbit patch the set, an antecedent conditioned on exactly what is in front
        of it (settled) named by its content alone."""
        states = [self._kv_state(p) for p in prefix]
        if kind != "orbit":
            return tuple(states)
        return frozenset(("settled", self.content[p]) if self.formed.get(p, ()) == tuple(prefix[:i])
                         and self._formed_states.get(p, ()) == tuple(states[:i]) else states[i]
                         for i, p in enumerate(prefix))

    def _is_stored(self, key: str, prefix: Sequence[str], kind: str) -> bool:
        kind = "exact" if kind == "recall" else kind
        return (self.content[key], kind, self._antecedent_states(prefix, kind)) in self._stored_patches

    def _store(self, key: str, prefix: Sequence[str], kind: str) -> None:
        kind = "exact" if kind == "recall" else kind
        self._stored_patches.add((self.content[key], kind, self._antecedent_states(prefix, kind)))

    def _set_formed(self, key: str, prefix: tuple[str, ...], how: str = "exact") -> None:
        """``key`` now holds conditioning on ``prefix`` (``how``: the patch kind, or ``"inline"``:
        a conditioned forward's own KV); an empty prefix: its canonical."""
        self.formed[key] = prefix
        self._formed_set.pop(key, None)
        how = "exact" if how == "recall" else how  # (one store kind: the same state)
        if not prefix:
            self._state.pop(key, None)
            self._formed_states.pop(key, None)
            self.pool.condition(key, None)
            return
        # the slot holds the stored patch (a conditioned forward's own KV is no store entry)
        self.pool.condition(key, None if how == "inline" else self._patch_key(key, prefix, how))
        states = tuple(self._kv_state(p) for p in prefix)
        self._formed_states[key] = states
        self._state[key] = kv_state(self.content[key], [how, repr(self._antecedent_states(prefix, how))])
