"""Placement policies: where chunks entering the window (append, recall) go.

Chunks are position-free, so a window's contents are a set and their order is a scheduling
variable. A placement policy is one small class that registers itself in
``PLACEMENT_POLICIES`` by subclassing :class:`PlacementPolicy` (the same style as patch
policies and reuse arms). It sees a :class:`PlacementView` — plain keys and facts, no tensors —
so the same policy object serves a live ``ContextWindow`` and the offline replay's cost model.

``arrival`` (here) keeps the order the agent asked for. ``scheduler``
(``contextdeque.scheduler``, registered when ``contextdeque`` is imported) searches for the
order that keeps stored patches valid and forms the fewest new ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Hashable, Iterable, Mapping, Sequence

from ..core.errors import WindowError
from ..core.registry import Registered, Registry

PLACEMENT_POLICIES: Registry["PlacementPolicy"] = Registry("placement policy")

Key = Hashable


def _never(*_: Any) -> bool:
    return False


def _nothing(*_: Any) -> tuple:
    return ()


@dataclass
class PlacementView:
    """What a placement policy sees.

    ``order``: resident keys in window order. Per key (residents and entering chunks):
    ``tokens``; ``content`` (content hash: equal contents share stored patches); ``formed_on``:
    the keys the chunk's current conditioning was formed on (for an entering recall, what it
    carried when it left; absent: new or blind). Store queries over contents: ``has_patch(c,
    prefix)`` (a stored exact/recall patch of content ``c`` on that ordered content prefix),
    ``has_orbit(c, set)``, ``stored_prefixes(c)`` (the content prefixes ``c`` has stored patches
    on). ``dependents(k)``: resident keys whose conditioning was formed on ``k`` (a recall of ``k``
    that changes its KV makes them stale: the recall cascade). ``budget_tokens``: the window's
    token budget (None: none). ``may_hit(c)``: whether any patch of ``c`` is stored (default: from
    ``stored_prefixes``). ``conditioning``: False for windows that carry no patches (blind or
    recompute arms), where order changes no cost. ``future``: offline knowledge, ``key -> index of its next
    reference`` (None: online).
    """

    order: Sequence[Key]
    tokens: Mapping[Key, int]
    content: Mapping[Key, str]
    formed_on: Mapping[Key, tuple[Key, ...]] = field(default_factory=dict)
    has_patch: Callable[[str, tuple[str, ...]], bool] = _never
    has_orbit: Callable[[str, frozenset], bool] = _never
    stored_prefixes: Callable[[str], Iterable[tuple[str, ...]]] = _nothing
    dependents: Callable[[Key], Sequence[Key]] = _nothing
    may_hit: Callable[[str], bool] | None = None
    conditioning: bool = True
    budget_tokens: int | None = None
    future: Mapping[Key, int] | None = None

    def any_stored(self, content: str) -> bool:
        """Whether the store holds any patch (exact, recall or orbit) of ``content``."""
        if self.may_hit is not None:
            return self.may_hit(content)
        return any(True for _ in self.stored_prefixes(content))


def let_go(view: PlacementView, need: int, candidates: Sequence[Key]) -> list[Key]:
    """The first ``candidates`` (residents, in the order they should go) to let go so that ``need``
    more tokens fit ``view``'s budget; none without a budget or when they already fit."""
    out: list[Key] = []
    if view.budget_tokens is None:
        return out
    used = sum(view.tokens[k] for k in view.order)
    for k in candidates:
        if used + need <= view.budget_tokens:
            break
        out.append(k)
        used -= view.tokens[k]
    return out


class PlacementPolicy(Registered):
    """Base class. Subclasses set ``name`` and implement :meth:`place` (and may override
    :meth:`make_room`)."""

    registry = PLACEMENT_POLICIES
    name: ClassVar[str] = ""

    def place(self, view: PlacementView, entering: Sequence[tuple[Key, int | None]]) -> list[Key]:
        """The window's new order: ``view.order`` with every entering ``(key, at)`` placed (``at``:
        the index the agent asked for, None = the end)."""
        raise NotImplementedError

    def make_room(self, view: PlacementView, need: int) -> list[Key]:
        """Residents to let go (in that order) so ``need`` more tokens fit the budget. Default:
        the oldest first, as ``overflow="slide"`` does."""
        return let_go(view, need, view.order)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ArrivalPlacement(PlacementPolicy):
    """The order the agent asked for: entering chunks at ``at`` or at the end."""

    name = "arrival"

    def place(self, view: PlacementView, entering: Sequence[tuple[Key, int | None]]) -> list[Key]:
        order = list(view.order)
        for key, at in entering:
            order.insert(len(order) if at is None else min(int(at), len(order)), key)
        return order


def make_placement(spec: "str | PlacementPolicy") -> PlacementPolicy:
    """A placement policy from its registered name, or the instance itself."""
    return PLACEMENT_POLICIES.make(spec, instance_of=PlacementPolicy, error=WindowError)


def window_index(ctx: Any, graph: Any, slots: Sequence[Any], entering: Any, at: int, formed_on: Sequence[Any] = ()) -> int:
    """Where ``ContextWindow`` puts an entering slot: ``at`` under arrival order; otherwise the
    index the window's placement policy chooses (its view of the window built from ``slots``, the
    conditioning ``graph`` and the patches this window family stored). Residents keep their
    relative order: the window honours where a policy puts the entering chunk among them."""
    policy = ctx.placement
    if policy is None or type(policy) is ArrivalPlacement or getattr(entering, "provisional", False):
        return at  # (a provisional slot's KV was computed behind the whole window: it stays last)
    from .kvstate import antecedent_states
    from .reconcile import patch_key_for

    by_key = {s.ref: s for s in slots}
    by_key[entering.ref] = entering
    ids_by_content: dict[str, Any] = {s.chunk.id: s.chunk for s in by_key.values()}
    # residents keep their relative order, hence their KV: a prefix of them is named by their states now
    state_by_content = {s.chunk.id: st for s, st in zip(slots, antecedent_states(slots))}

    def has_patch(content: str, prefix: tuple[str, ...]) -> bool:
        chunk = ids_by_content.get(content)
        if chunk is None or any(c not in state_by_content for c in prefix):
            return False
        ranks = ctx.formation_ranks(ctx.rank, chunk.n_tokens)
        return ctx.store.has(patch_key_for(ctx, chunk, [state_by_content[c] for c in prefix], "exact", ranks))

    resident = {s.ref for s in slots}
    view = PlacementView(
        order=[s.ref for s in slots],
        tokens={k: s.n_tokens for k, s in by_key.items()},
        content={k: s.chunk.id for k, s in by_key.items()},
        formed_on={**{s.ref: tuple(a for a, _ in s.conditioned_on) for s in slots},
                   entering.ref: tuple(a for a, _ in formed_on)},
        has_patch=has_patch,
        stored_prefixes=lambda c: tuple(ctx.patch_index.get(c, ())),
        dependents=lambda k: [d for d in graph.dependents(k) if d in resident],
        budget_tokens=ctx.budget_tokens,
    )
    order = policy.place(view, [(entering.ref, at)])
    rest = [k for k in order if k != entering.ref]
    if rest != view.order:  # a policy that also moves residents: keep theirs, take its slot
        before = set(order[: order.index(entering.ref)])
        return sum(1 for s in slots if s.ref in before)
    return order.index(entering.ref)
