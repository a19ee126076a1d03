"""Staleness: how far a slot's conditioning is from what its current prefix would give it.

A score in [0, 1] per slot, 0 when the conditioning it carries was formed on exactly the
chunks (and chunk states) now in front of it, 1 when it carries nothing useful: a blind
canonical behind a non-empty prefix, or a patch formed on antecedents none of which is still in
front of it. In between it is token-weighted: the share of the antecedent tokens (old and new
together) that the patch was formed on and that still precede the slot in the same state,
discounted by half the fraction of those shared antecedents whose relative order changed.

This is the safety envelope's cheap proxy for the deficit a patch leaves (it needs no forward):
the latency-first policy serves a stale patch only while its score is within the policy's
staleness budget, and healing works on the stalest slots first.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from .slot import Slot


def staleness(slot: Slot, prefix: Sequence[Slot]) -> float:
    """Staleness of ``slot``'s current conditioning behind ``prefix`` (see the module doc)."""
    return staleness_score(
        [(tag, tag[0].n_tokens) for tag in slot.conditioned_on],
        [((s.ref, s.version), s.n_tokens) for s in prefix],
    )


def staleness_score(formed: Sequence[tuple[Hashable, int]], prefix: Sequence[tuple[Hashable, int]]) -> float:
    """The score on plain data: ``formed`` = the antecedents the conditioning was formed on and
    ``prefix`` = what now precedes the chunk, each as ``(antecedent state, tokens)`` in window
    order (a state is anything hashable naming an antecedent *and* its KV version). ``formed``
    empty means blind. Used by the window (slots) and by the placement scheduler (plain keys)."""
    if not prefix:  # nothing in front: the canonical is exact, any conditioning is foreign
        return 1.0 if formed else 0.0
    if not formed:
        return 1.0
    now = dict(prefix)
    old = dict(formed)
    shared = [tag for tag, _ in formed if tag in now]
    union = sum(now.values()) + sum(w for tag, w in old.items() if tag not in now)
    if not union:
        return 0.0
    kept = sum(now[tag] for tag in shared)
    order_now = {tag: i for i, tag in enumerate(now)}
    ranks = [order_now[tag] for tag in shared]
    pairs = len(ranks) * (len(ranks) - 1) // 2
    inverted = sum(1 for i in range(len(ranks)) for j in range(i + 1, len(ranks)) if ranks[i] > ranks[j])
    order_penalty = 0.5 * inverted / pairs if pairs else 0.0
    return float(min(1.0, max(0.0, 1.0 - (kept / union) * (1.0 - order_penalty))))
