"""Placement policies: where chunks entering the window (append, recall) go.

Chunks are position-free, so a window's contents are a set and their order is a scheduling
variable. A placement policy is one small class that registers itself in
``PLACEMENT_POLICIES`` by subclassing :class:`PlacementPolicy` (the same style as patch
policies and reuse arms). It sees a :class:`PlacementView` — plain keys and facts, no tensors —
so the same policy object serves a live ``ContextWindow`` and the offline replay's cost model.

``arrival`` (here) keeps the order the agent asked for. ``scheduler`` and ``valid`` (the default
``recall_placement``), defined in ``contextdeque.scheduler``, search for the order that keeps
stored patches valid and forms the fewest new ones: a higher layer, which this one never imports;
``PLACEMENT_POLICIES`` names it as their home (``core.registry``), so looking either name up
imports it whatever the process imported before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Hashable, Iterable, Mapping, Sequence

from ..core.errors import WindowError
from ..core.registry import Registered, Registry

SCHEDULER_MODULE = "contextdeque.scheduler"
"""Where the placement scheduler's policies (``"scheduler"``, ``"scheduler-offline"`` and
``"valid"``, the default ``recall_placement``) are defined: imported when one is looked up."""

PLACEMENT_POLICIES: Registry["PlacementPolicy"] = Registry(
    "placement policy", homes=dict.fromkeys(("scheduler", "scheduler-offline", "valid"), SCHEDULER_MODULE))

END = "end"
"""``recall(ref, at=END)``: insist on the window's end (``recall(ref)`` lets the window choose)."""

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
    reference`` (None: online). ``patch_policy``: the window's patch policy, whose decisions a
    placement's objective prices (None: the default eager policy).
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
    patch_policy: Any = None  # the window's patch policy (what its plan for an order is decided by); None: eager

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


def window_index(ctx: Any, graph: Any, slots: Sequence[Any], entering: Any, at: int | None, formed_on: Sequence[Any] = (),
                 policy: "PlacementPolicy | None" = None) -> int:
    """Where ``ContextWindow`` puts an entering slot: ``at`` (None: the end) under arrival order;
    otherwise the index the placement policy (``policy``, default the window's) chooses (its view of
    the window built from ``slots``, the conditioning ``graph`` and the patches this window family
    stored). Residents keep their relative order: the window honours where a policy puts the
    entering chunk among them."""
    policy = policy if policy is not None else ctx.placement
    if at is None and (policy is None or type(policy) is ArrivalPlacement or getattr(entering, "provisional", False)):
        return len(slots)
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
        stored_prefixes=ctx.patch_index.stored_prefixes,
        dependents=lambda k: [d for d in graph.dependents(k) if d in resident],
        budget_tokens=ctx.budget_tokens,
        patch_policy=ctx.policy,
    )
    order = policy.place(view, [(entering.ref, at)])
    rest = [k for k in order if k != entering.ref]
    if rest != view.order:  # a policy that also moves residents: keep theirs, take its slot
        before = set(order[: order.index(entering.ref)])
        return sum(1 for s in slots if s.ref in before)
    return order.index(entering.ref)


def recall_chooser(ctx: Any) -> PlacementPolicy | None:
    """The placement policy for recalls the agent does not pin (``WindowConfig.recall_placement``),
    made on first use and kept on the window family's context (a name is found whatever was
    imported: ``PLACEMENT_POLICIES.homes``). None for ``recall_placement=None`` (the window's own
    placement at the end: the rule before issue 21).

    Raises:
        WindowError: the name is not a registered placement policy (a typo)."""
    spec = ctx.recall_placement
    if spec is None or isinstance(spec, PlacementPolicy):
        return spec
    if spec not in PLACEMENT_POLICIES:
        raise WindowError(f"recall_placement {spec!r} is not a registered placement policy (registered: "
                          f"{', '.join(sorted(PLACEMENT_POLICIES))}), or pass recall_placement=None")
    ctx.recall_placement = make_placement(spec)
    return ctx.recall_placement


def placement_reason(ctx: Any, slots: Sequence[Any], entering: Any, index: int, pinned: bool) -> str:
    """Why an entering chunk stands at ``index`` among ``slots`` (the residents as they stand
    around it): ``"asked"`` (the agent pinned it), else what made the place worth taking:
    ``"front: canonical exact"``, ``"behind its stored patch's antecedents"`` (a stored exact patch
    on exactly that prefix applies), ``"end"`` or ``"scheduler: fewest forms"``."""
    if pinned:
        return "asked"
    if index == 0:
        return "front: canonical exact"
    from .kvstate import antecedent_states
    from .reconcile import patch_key_for

    ranks = ctx.formation_ranks(ctx.rank, entering.chunk.n_tokens)
    prefix = antecedent_states(slots[:index])  # (patch keys name the antecedents' states)
    if ctx.store.has(patch_key_for(ctx, entering.chunk, prefix, "exact", ranks)):
        return "behind its stored patch's antecedents"
    return "end" if index == len(slots) else "scheduler: fewest forms"
