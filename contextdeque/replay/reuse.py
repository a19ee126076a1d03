"""Reuse arms in the replay's cost model: what each arm of ``contextdeque.eval.arms`` costs per window
operation and per query. One small class per file (``reuse_<arm>.py``), registered in
``REUSE_COSTS`` under the arm's name in ``contextdeque.eval.arms.ARMS`` (a cost rule for an arm that
does not exist is refused at import).

Hooks: ``canonicals`` (chunks are encoded once into the store and read from it on entry),
``patches`` (entering chunks get conditioning patches: the window's own patch policy decides
which, over key-only slots), ``defers`` (the latency-first patch policy: new content is one
forward after the window, the rest waits for the heal at the next step boundary),
:meth:`canonical_bytes` (what a canonical takes at rest) and :meth:`query` (what one read of the
window costs beyond that). A rule that prices a live window's patch policy names it in
``window_policy`` and takes ``patches`` / ``defers`` / ``lazy_canonicals`` from that policy
(``PatchPolicy.conditions`` / ``defers_canonical`` / ``lazy_canonicals``): it restates nothing.

A rule may price a variant of an arm under its own name (``arm`` names the arm it prices:
``patch-latency`` prices ``patch`` under ``patch_policy="latency"``). A rule with ``budgeted``
takes its per-head row budget from the name, as the arm's label spells it (``snapkv-256``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ..core.registry import Registered, Registry
from ..eval.arms import ARMS
from ..core.errors import PolicyError
from ..window import PATCH_POLICIES
from ..window.plan import Forward

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Replayer

REUSE_COSTS: Registry["ReuseCost"] = Registry("reuse cost")


class ReuseCost(Registered):
    registry = REUSE_COSTS
    name: ClassVar[str] = ""
    arm: ClassVar[str] = ""  # the arm of contextdeque.eval.arms it prices (default: ``name``)
    canonicals: ClassVar[bool] = True
    patches: ClassVar[bool] = False
    defers: ClassVar[bool] = False
    lazy_canonicals: ClassVar[bool] = True  # with ``defers``: canonicals only when a re-read needs them
    budgeted: ClassVar[bool] = False
    # the patch policy of the live window this rule prices (``replay/live.py``: the window the
    # fidelity mode drives and the equality test checks it against); None: a query-time arm
    # (``contextdeque.eval.arms``) with no window policy of its own
    window_policy: ClassVar[str | None] = None
    default_budget: ClassVar[int] = 256

    def __init_subclass__(cls, **kw: Any) -> None:
        name = cls.__dict__.get("name")
        arm = cls.__dict__.get("arm") or name
        if name and arm not in ARMS:
            raise PolicyError(f"reuse cost {name!r} names no arm of contextdeque.eval.arms ({sorted(ARMS)})")
        policy_name = cls.__dict__.get("window_policy")
        if policy_name:  # what the window's policy does, from the policy itself
            policy = PATCH_POLICIES[policy_name]
            cls.patches, cls.defers, cls.lazy_canonicals = policy.conditions, policy.defers_canonical, policy.lazy_canonicals
        super().__init_subclass__(**kw)

    def __init__(self, budget: int | None = None) -> None:
        if budget is not None and not self.budgeted:
            raise PolicyError(f"reuse cost {self.name!r} takes no budget (got {budget!r})")
        if self.budgeted:
            budget = self.default_budget if budget is None else budget
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise PolicyError(f"reuse cost {self.name!r}: budget must be an int >= 1 rows per KV head, got {budget!r}")
        self.budget = budget

    @property
    def label(self) -> str:
        """The name results carry (``snapkv-256`` for a budgeted rule)."""
        return f"{self.name}-{self.budget}" if self.budgeted else self.name

    def copy(self) -> "ReuseCost":
        return type(self)(self.budget) if self.budgeted else type(self)()

    def canonical_bytes(self, tokens: int, kv_bytes_per_token: int) -> int:
        """Bytes a ``tokens``-token canonical takes at rest in the pool."""
        return tokens * kv_bytes_per_token

    def query(self, eng: "Replayer", q_tokens: int, out_tokens: int) -> None:
        """Charge one read of the window (the query's own tokens are charged by the engine)."""
        eng.charge_apply(eng.window_tokens)

    def recompute(self, eng: "Replayer", tokens: int) -> None:
        """Charge ``tokens`` recomputed in context at query time (one partial forward)."""
        if tokens > 0:
            eng.do(Forward("recompute", tokens, context=eng.window_tokens - tokens), window_op=False)


def make_reuse(spec: "str | ReuseCost") -> ReuseCost:
    """A cost rule by name (``<name>-<budget>`` for a budgeted one), or the instance itself."""
    if isinstance(spec, str) and spec not in REUSE_COSTS:
        base, _, tail = spec.rpartition("-")
        cls = REUSE_COSTS.get(base)
        if cls is not None and cls.budgeted and tail.isdigit():
            return cls(int(tail))
    try:
        return REUSE_COSTS.make(spec, instance_of=ReuseCost, error=PolicyError)
    except PolicyError as exc:
        budgeted = sorted(k for k, c in REUSE_COSTS.items() if c.budgeted)
        raise PolicyError(f"{exc} (budgeted ones also as NAME-ROWS: {budgeted})") from None


def is_reuse(spec: str) -> bool:
    """Whether ``spec`` names a cost rule :func:`make_reuse` builds."""
    try:
        make_reuse(spec)
    except PolicyError:
        return False
    return True
