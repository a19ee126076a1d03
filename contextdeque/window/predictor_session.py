"""The ``session`` recall predictor (the default): the agent's hints, recency, and statistics
learned from the window's own steps.

What it learns, per window family, from the operations it observes:

- **groups**: chunks evicted by consecutive evictions (no other operation between) left together,
  a web page's screenshot and text, a video segment's frames; ``follow`` is how often a recall
  of one member was followed by the recall of the member evicted right after it (the group comes
  back together, in the order it left). A group is predicted as one chain while that stays likely.
- **which**: how recent the recalled chunk's group was among the evicted groups (rank 0: the last
  group to leave), a histogram smoothed towards a recency prior 1 / (1 + rank).
- **where**: how often a recall went to the end, or to the front (a look-back).
- **how often**: recalls per evicted group, the chance that an evicted group comes back at all.
- **the front**: how often an evicting step took the window's front chunk (what preparing the
  next slide is worth: agents that keep their task in front never slide it out).

What the agent said (:meth:`~contextdeque.window.ContextWindow.expect`) comes first: the hints
as one chain in the order given, then the chain's shorter prefixes (the longest that fits the
idle budget is prepared), and, less likely, each later hint alone. Each prediction is priced by
:func:`~.predictor.chain_tokens` (the conditioning graph's recall cascade included); a chain's
saving counts each later member at the learned chance that the group goes on.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Mapping

from .placement import END
from .predictor import CANDIDATES, Prediction, RecallPredictor, Recall, chain_tokens, hinted, priced, recent_evicted
from .ref import ChunkRef

if TYPE_CHECKING:  # pragma: no cover
    from .receipt import Receipt
    from .state import WindowState

HINT_PROBABILITY = 0.9  # the agent said it may look there next
PREFIX_DISCOUNT = 0.001  # a hinted chain's shorter prefixes rank right after it, longest first
ALONE_DISCOUNT = 0.5  # a later hint recalled before the ones named ahead of it: possible, less likely
MIN_CHAIN_PROBABILITY = 0.1  # a chain stops where the chance that the group gets that far falls below this
PRIOR_WEIGHT = 2.0  # pseudo-observations of the recency prior in the learned rank histogram
EVICTING = ("evict", "slide")
REMEMBERED = 4096  # group memberships kept before those of refs no longer evicted are dropped


class SessionPredictor(RecallPredictor):
    name = "session"

    def __init__(self) -> None:
        self.group_of: dict[ChunkRef, int] = {}
        self.members: dict[int, list[ChunkRef]] = {}  # group -> refs in eviction order
        self.groups_evicted = 0
        self.recalls = 0
        self.rank_seen: Counter[int] = Counter()
        self.where: Counter[str] = Counter()
        self.follows = 0
        self.chances = 0
        self._last_op = ""
        self._waiting_for: ChunkRef | None = None  # the member evicted right after the last recalled one
        self.front_left = 0  # evicting steps that took the window's front chunk
        self.evicting_steps = 0
        self._front: ChunkRef | None = None  # the front chunk after the last step

    # ------------------------------------------------------------------ learning
    def observe(self, receipt: "Receipt", state: "WindowState") -> None:
        op = receipt.op
        if op in ("heal", "anticipate", "materialize", "generate", "is_disposable", "refresh"):
            return  # not an agent's step
        if self._waiting_for is not None:  # did the group go on?
            self.chances += 1
            self.follows += int(op == "recall" and receipt.refs[:1] == (self._waiting_for,))
            self._waiting_for = None
        if op == "recall" and receipt.refs:
            self._learn_recall(receipt.refs[0], state)
        if op in EVICTING and receipt.left:
            self.evicting_steps += 1
            self.front_left += int(self._front in receipt.left)
        self._front = state.refs[0] if state.refs else None
        if receipt.left:
            # (a run of evicting steps is one group; the run's first step may have let nothing go —
            # a slide of 0 — or its group may have been forgotten: then this one starts it)
            if op not in EVICTING or self._last_op not in EVICTING or self.groups_evicted not in self.members:
                self.groups_evicted += 1
                self.members[self.groups_evicted] = []
            for ref in receipt.left:
                self.group_of[ref] = self.groups_evicted
                self.members[self.groups_evicted].append(ref)
        self._last_op = op
        if len(self.group_of) > REMEMBERED:  # bounded: forget the refs that are back or forgotten
            self.group_of = {r: g for r, g in self.group_of.items() if r in state.evicted}
            kept = set(self.group_of.values())
            self.members = {g: [r for r in m if r in self.group_of] for g, m in self.members.items() if g in kept}

    def _learn_recall(self, ref: ChunkRef, state: "WindowState") -> None:
        self.recalls += 1
        group = self.group_of.get(ref)
        if group is not None:
            newer = {self.group_of.get(r) for r in state.evicted if self.group_of.get(r, 0) > group}
            self.rank_seen[len(newer)] += 1
            members = self.members[group]
            later = members[members.index(ref) + 1:]
            self._waiting_for = next((r for r in later if r in state.evicted), None)
        if ref in state.refs:
            idx, n = state.index(ref), len(state.slots)
            self.where["front" if idx == 0 and n > 1 else "end" if idx == n - 1 else "inside"] += 1

    # ------------------------------------------------------------------ estimates
    def p_rank(self, rank: int) -> float:
        """Chance that the recalled group is the ``rank``-th most recent evicted one."""
        norm = sum(1.0 / (1 + r) for r in range(CANDIDATES))
        prior = (1.0 / (1 + rank)) / norm
        n = sum(self.rank_seen.values())
        return (self.rank_seen[rank] + PRIOR_WEIGHT * prior) / (n + PRIOR_WEIGHT)

    def p_front_leaves(self) -> float:
        """How often an evicting step took the front chunk (prior 1/2): agents that keep their
        task or question in front never slide it out."""
        return (self.front_left + 1) / (self.evicting_steps + 2)

    @property
    def p_follow(self) -> float:
        """Chance that a recalled group member is followed by the next one (prior 2/3: agents
        tend to bring back a page or a segment whole)."""
        return (self.follows + 2) / (self.chances + 3)

    @property
    def p_recalled(self) -> float:
        """Chance that an evicted group comes back (prior 1/2)."""
        return min(1.0, (self.recalls + 1) / (self.groups_evicted + 2))

    def p_where(self) -> dict[int | str | None, float]:
        """``at -> chance``: the end (``"end"``), the front (0), or, once recalls were seen
        landing inside, where ``recall(ref)`` without ``at`` puts it (None: the window's recall
        placement); prior 2:1 for the end."""
        total = self.where["end"] + self.where["front"] + self.where["inside"] + 3
        out: dict[int | str | None, float] = {END: (self.where["end"] + 2) / total, 0: (self.where["front"] + 1) / total}
        if self.where["inside"]:
            out[None] = self.where["inside"] / total
        return out

    # ------------------------------------------------------------------ predictions
    def predict(self, state: "WindowState", expected: Mapping[ChunkRef, int | None]) -> list[Prediction]:
        out: list[Prediction] = []
        hints = hinted(state, expected)
        chain = [r for group in hints for r in group]
        # every hint, in the order given: one chain, then its shorter prefixes (the recalls that
        # come first, what a smaller idle budget can still prepare: each prefix is the start of
        # the chain's own arrangement, so its patches serve the chain too), longest first
        for n in range(len(chain), 0, -1):
            out.append(priced(state, chain[:n], HINT_PROBABILITY * (1.0 - PREFIX_DISCOUNT * (len(chain) - n)), "expected"))
        if len(hints) > 1:  # each later hint alone, in case the agent goes there first: after the chain
            out += [priced(state, group, HINT_PROBABILITY * ALONE_DISCOUNT, "expected") for group in reversed(hints[1:])]
        groups: dict[int | ChunkRef, list[ChunkRef]] = {}  # most recent group first; members in eviction order
        for ref in recent_evicted(state):
            groups.setdefault(self.group_of.get(ref, ref), []).insert(0, ref)
        where = self.p_where()
        for rank, members in enumerate(groups.values()):
            p_group = self.p_recalled * self.p_rank(rank)
            for at, p_at in where.items():
                for i in range(len(members)):  # the group from its first member, or from a later one
                    out.append(self._chain(state, members[i:], at, p_group * p_at / (1 if i == 0 else len(members))))
        return out

    def _chain(self, state: "WindowState", members: list[ChunkRef], at: int | None, p: float) -> Prediction:
        """The group from its first member on, while it likely goes on (each later member's saving
        counted at the chance that the group gets that far)."""
        recalls: list[Recall] = []
        cost = saved = 0.0
        done = 0  # saved tokens of the chain so far, undiscounted
        go_on = 1.0
        for i, ref in enumerate(members):
            if i and go_on * self.p_follow < MIN_CHAIN_PROBABILITY:
                break
            go_on *= self.p_follow if i else 1.0
            recalls.append((ref, at if not isinstance(at, int) else at + i))
            c, s = chain_tokens(state, recalls)  # (the chain so far: a dependent re-formed once)
            cost, saved = c, saved + go_on * (s - done)
            done = s
        return Prediction(tuple(recalls), p, int(cost), int(round(saved)), "group" if len(recalls) > 1 else "recency")
