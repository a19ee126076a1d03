"""Reuse arms in the replay's cost model: what each arm of ``contextdeque.eval.arms`` costs per window
operation and per query. One small class per file (``reuse_<arm>.py``), registered in
``REUSE_COSTS`` under the arm's name in ``contextdeque.eval.arms.ARMS`` (a cost rule for an arm that
does not exist is refused at import).

Hooks: ``canonicals`` (chunks are encoded once into the store and read from it on entry),
``patches`` (entering chunks get conditioning patches per the window's default patch policy),
and :meth:`query` (what one read of the window costs beyond that).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ..core.registry import Registered, Registry
from ..eval.arms import ARMS
from ..scheduler.eviction import PolicyError

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Replayer

REUSE_COSTS: Registry["ReuseCost"] = Registry("reuse cost")


class ReuseCost(Registered):
    registry = REUSE_COSTS
    name: ClassVar[str] = ""
    canonicals: ClassVar[bool] = True
    patches: ClassVar[bool] = False

    def __init_subclass__(cls, **kw: Any) -> None:
        name = cls.__dict__.get("name")
        if name and name not in ARMS:
            raise PolicyError(f"reuse cost {name!r} names no arm of contextdeque.eval.arms ({sorted(ARMS)})")
        super().__init_subclass__(**kw)

    def query(self, eng: "Replayer", q_tokens: int, out_tokens: int) -> None:
        """Charge one read of the window (the query's own tokens are charged by the engine)."""
        eng.charge_apply(eng.window_tokens)

    def recompute(self, eng: "Replayer", tokens: int) -> None:
        """Charge ``tokens`` recomputed in context at query time (one partial forward)."""
        if tokens > 0:
            eng.r.tokens_prefilled += tokens
            eng.r.forwards += 1
            eng.r.est_seconds += eng.cost.prefill_s(tokens, eng.window_tokens - tokens)


def make_reuse(spec: "str | ReuseCost") -> ReuseCost:
    return REUSE_COSTS.make(spec, instance_of=ReuseCost, error=PolicyError)
