"""Patch policies: when a slot gets a conditioning patch, of which kind and rank.

A policy is one small class in its own file (``policy_default.py``, ``policy_exact.py``,
``policy_none.py``) that registers itself in ``PATCH_POLICIES`` by subclassing
:class:`PatchPolicy`. After every window operation the window walks its slots in order and asks
the policy, for each slot, what to do given *why* the slot is being looked at (the reason) and
what now precedes it (the prefix). The answer is a :class:`Decision`; the window carries it out
(store lookup first, one conditioned forward only on a miss) and re-places the slot's page.

Reasons:
  ``append``    the slot was just appended (no conditioning yet);
  ``recall``    the slot was just recalled from its canonical (no conditioning yet);
  ``survivor``  antecedents before it left the window (slide, mid-window eviction);
  ``inserted``  a recalled chunk was inserted before it;
  ``reorder``   the window was permuted;
  ``cascade``   a recall made its patch stale and the cascade policy is ``reform``;
  ``refresh``   ``ContextWindow.refresh`` asked to re-condition it;
  ``None``      nothing happened to it (an earlier slot may still have changed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from ..core.errors import WindowError
from ..core.registry import Registered, Registry
from .slot import Slot

PATCH_POLICIES: Registry["PatchPolicy"] = Registry("patch policy")

DEFAULT_POLICY = "latency"
"""What ``patch_policy="default"`` means: latency-first over the eager policy (re-reads run no
forward on the critical path; ``heal()`` brings the window to what ``"eager"`` builds)."""


@dataclass(frozen=True)
class Decision:
    """What to do with one slot.

    ``action``: ``keep`` (conditioning unchanged; only re-placed if its start moved), ``clear``
    (drop every patch: the canonical, which is exact when nothing precedes the slot) or
    ``form`` (a patch of ``kind`` at ``rank`` on the current prefix).
    ``stack``: put the new patch on top of the current ones (removal patches) instead of
    replacing them. ``reuse_only``: take it from the store if there, else do ``fallback``.
    ``options``: passed to ``form_patch`` (e.g. ``max_orderings`` for orbit patches).
    ``deferred``: this ``keep``/``clear`` stands in for conditioning the policy chose not to form
    on the critical path (latency-first): the window queues the slot for :meth:`heal
    <contextdeque.ContextWindow.heal>` and says so in the receipt.
    """

    action: str
    kind: str | None = None
    rank: int | str | None = None
    stack: bool = False
    reuse_only: bool = False
    fallback: "Decision | None" = None
    options: tuple[tuple[str, Any], ...] = ()
    deferred: bool = False

    def __post_init__(self) -> None:
        if self.action not in ("keep", "clear", "form"):
            raise ValueError(f"unknown decision action {self.action!r}")

    @property
    def may_keep(self) -> bool:
        """Whether the recall cascade re-decides this slot: a plain ``keep`` (not a ``deferred``
        one: that is queued for the heal). A store-only patch that falls back to keep (a chunk a
        recall is inserted before: ``reason == "inserted"``) is carried out as decided: its
        stored patch on the new prefix where the store has one, else it keeps what it carries,
        as a survivor does (the seed paper: near-lossless; re-forming it instead cost the
        look-back its 0-forward step: 2 chunks deferred blind, tests/test_step_bench.py)."""
        return self.action == "keep" and not self.deferred


KEEP = Decision("keep")
CLEAR = Decision("clear")


def form(kind: str, rank: int | str, **kw: Any) -> Decision:
    options = tuple(sorted(kw.pop("options", {}).items()))
    return Decision("form", kind=kind, rank=rank, options=options, **kw)


class PatchPolicy(Registered):
    """Base class of a patch policy. Subclasses set ``name`` and implement :meth:`decide`.

    ``regime`` namespaces the patches the policy stores: patches are keyed by the antecedents'
    chunk ids, which only pins down the antecedents' *state* when every chunk in the window is
    conditioned the same way. The exact policy's patches are exact on exact antecedents; they
    must not be served to (or from) a window whose antecedents carry approximate conditioning.
    """

    registry = PATCH_POLICIES
    name: ClassVar[str] = ""
    regime: ClassVar[str] = "approx"
    #: it gives slots conditioning patches at all (the blind policy does not)
    conditions: ClassVar[bool] = True
    #: new content costs one conditioned forward and no canonical yet (latency-first policies)
    defers_canonical: ClassVar[bool] = False
    #: a deferred canonical waits until a re-read needs it (``latency``), instead of being
    #: computed while healing (``latency-shared``)
    lazy_canonicals: ClassVar[bool] = False

    def decide(self, reason: str | None, slot: Slot, prefix: Sequence[Slot], *, valid: bool, rank: int) -> Decision:
        """The decision for ``slot`` placed after ``prefix``.

        ``valid``: the slot's conditioning was formed on exactly the current prefix (same
        chunks, same states, same order). ``rank``: the window's rank m.
        """
        raise NotImplementedError

    def describe(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def make_policy(spec: "str | PatchPolicy") -> PatchPolicy:
    """A policy instance from its registered name (``"name:arg"`` passes one argument, e.g.
    ``"latency:exact"``), or the instance itself."""
    if isinstance(spec, PatchPolicy):
        return spec
    if spec == "default":
        spec = DEFAULT_POLICY
    if isinstance(spec, str):
        name, _, arg = spec.partition(":")
        if name in PATCH_POLICIES:
            return PATCH_POLICIES[name](arg) if arg else PATCH_POLICIES[name]()
    raise WindowError(f"unknown patch policy {spec!r}; registered: {sorted(PATCH_POLICIES)}")
