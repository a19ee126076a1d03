"""WindowConfig: a window's settings in one frozen object, validated once, with the defaults in one
place (``DEFAULT_RANK``, the patch rank m every entry point defaults to, is written in
``patch/rank.py``, below every layer that needs it).

``ContextWindow(backend, **settings)`` builds one from its keywords; ``ContextWindow.from_config``
takes one as it is. Policies and placements are kept as given (a name or an instance): the window
makes the instances, the settings only name them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..core.args import check_float, check_int, check_str
from ..core.chunk import storage_dtype
from ..core.errors import BudgetError, WindowError, WindowTypeError
from ..patch.alloc import DEFAULT_ON_MISS, ON_MISS
from ..patch.factors import DEFAULT_PATCH_PRECISIONS, check_precisions
from .budget import DEFAULT_BLIND_KL
from ..patch.rank import DEFAULT_RANK  # (re-exported: the one default rank, written in patch/rank.py)
from .graph import CASCADE_POLICIES
from .kvselect import SelectionPolicy
from .placement import PlacementPolicy
from .policy import PatchPolicy
from .predictor import RECALL_PREDICTORS, RecallPredictor

DEFAULT_RECALL_PLACEMENT = "valid"
"""Where ``recall(ref)`` (no ``at``) goes: ``"valid"`` (``contextdeque.scheduler``: where a stored
patch stays valid — behind the chunks its patch was formed on, or the front where its canonical is
exact — else the end). Chosen by measurement: docs/placement.md and ``window-bench``'s
``recall-valid`` row."""
DEFAULT_KL_BUDGET_MS = 2000.0
"""The time cap of the patch an ``answer_kl_budget`` forms on the critical path (window.budget)."""
DEFAULT_MAX_EVICTED = 10_000  # evicted refs a window remembers unless told otherwise
OVERFLOW_POLICIES = ("slide", "error")


@dataclass(frozen=True)
class WindowConfig:
    """The settings of a window family (a window and its forks); see :class:`~.window.ContextWindow`
    for what each one does. Every field is checked when the object is made (a wrong type raises
    ``WindowTypeError``, a wrong value ``WindowError`` / ``BudgetError``); ``storage`` is kept as
    a dtype whichever way it was named."""

    budget_tokens: int | None = None
    rank: int = DEFAULT_RANK
    patch_policy: "str | PatchPolicy" = "default"
    cascade_policy: str = "reform"
    overflow: str = "slide"
    storage: "torch.dtype | str" = torch.float32
    placement: "str | PlacementPolicy" = "arrival"
    recall_placement: "str | PlacementPolicy | None" = DEFAULT_RECALL_PLACEMENT
    fidelity_target: float | None = None
    max_patch_fraction: float = 0.25
    on_miss: str = DEFAULT_ON_MISS
    patch_precisions: "tuple[str, ...] | list[str]" = DEFAULT_PATCH_PRECISIONS
    kv_selection: SelectionPolicy | None = None
    beyond_trained: bool = False
    chunk_template: str = "{text}"
    max_evicted: int | None = DEFAULT_MAX_EVICTED
    anticipate: bool = True
    answer_kl_budget: float | None = None
    kl_budget_ms: float | None = DEFAULT_KL_BUDGET_MS
    blind_kl: float = DEFAULT_BLIND_KL
    recall_predictor: "str | RecallPredictor" = "session"
    factorization_cost: float = 0.0
    factorization_fixed: float = 0.0
    forward_fixed: float = 0.0

    def __post_init__(self) -> None:
        if self.kv_selection is not None and not isinstance(self.kv_selection, SelectionPolicy):
            raise WindowTypeError(f"kv_selection must be a SelectionPolicy, got {type(self.kv_selection).__name__}")
        if not isinstance(self.patch_policy, (str, PatchPolicy)):
            raise WindowTypeError(f"patch_policy must be a policy name or a PatchPolicy, got {type(self.patch_policy).__name__}")
        for name in ("placement", "recall_placement"):
            value = getattr(self, name)
            if not isinstance(value, (str, PlacementPolicy)) and not (name == "recall_placement" and value is None):
                raise WindowTypeError(f"{name} must be a policy name or a PlacementPolicy, got {type(value).__name__}")
        if isinstance(self.recall_predictor, str):
            if self.recall_predictor not in RECALL_PREDICTORS:
                raise WindowError(f"unknown recall predictor {self.recall_predictor!r}; registered: {sorted(RECALL_PREDICTORS)}")
        elif not isinstance(self.recall_predictor, RecallPredictor):
            raise WindowTypeError(f"recall_predictor must be a predictor name or a RecallPredictor, got "
                                  f"{type(self.recall_predictor).__name__}")
        check_str("cascade_policy", self.cascade_policy, error=WindowError)
        if self.cascade_policy not in CASCADE_POLICIES:
            raise WindowError(f"cascade_policy must be one of {CASCADE_POLICIES}, got {self.cascade_policy!r}")
        check_str("on_miss", self.on_miss, choices=ON_MISS, error=WindowError)
        check_str("overflow", self.overflow, error=WindowError)
        if self.overflow not in OVERFLOW_POLICIES:
            raise WindowError(f"overflow must be one of {OVERFLOW_POLICIES}, got {self.overflow!r}")
        if not isinstance(self.storage, (str, torch.dtype)):
            raise WindowTypeError(f"storage must be a dtype or its name, got {type(self.storage).__name__}")
        for flag in ("beyond_trained", "anticipate"):
            if not isinstance(getattr(self, flag), bool):
                raise WindowTypeError(f"{flag} must be a bool, got {type(getattr(self, flag)).__name__}")
        from .ingest import check_template  # (ingest stands on the context, which stands on this)
        from .policy import make_policy

        check_template(self.chunk_template)
        make_policy(self.patch_policy)  # an unknown name is refused here, once (WindowError), not at first use
        checked = dict(
            rank=check_int("rank", self.rank, minimum=0, error=WindowError),
            budget_tokens=check_int("budget_tokens", self.budget_tokens, minimum=1, none_ok=True, error=BudgetError),
            storage=storage_dtype(self.storage),
            fidelity_target=check_float("fidelity_target", self.fidelity_target, minimum=0.0, maximum=1.0, open_min=True,
                                        none_ok=True, error=WindowError),
            max_patch_fraction=check_float("max_patch_fraction", self.max_patch_fraction, minimum=0.0, maximum=1.0,
                                           open_min=True, error=WindowError),
            max_evicted=check_int("max_evicted", self.max_evicted, minimum=0, none_ok=True, error=WindowError),
            answer_kl_budget=check_float("answer_kl_budget", self.answer_kl_budget, minimum=0.0, none_ok=True,
                                         error=WindowError),
            kl_budget_ms=check_float("kl_budget_ms", self.kl_budget_ms, minimum=0.0, none_ok=True, error=WindowError),
            blind_kl=check_float("blind_kl", self.blind_kl, minimum=0.0, open_min=True, error=WindowError),
            factorization_cost=check_float("factorization_cost", self.factorization_cost, minimum=0.0, error=WindowError),
            factorization_fixed=check_float("factorization_fixed", self.factorization_fixed, minimum=0.0, error=WindowError),
            forward_fixed=check_float("forward_fixed", self.forward_fixed, minimum=0.0, error=WindowError),
        )
        if isinstance(self.patch_precisions, str) or not isinstance(self.patch_precisions, (tuple, list)):
            raise WindowTypeError(f"patch_precisions must be a tuple of precision names, got {type(self.patch_precisions).__name__}")
        try:
            checked["patch_precisions"] = check_precisions(self.patch_precisions)
        except ValueError as exc:
            raise WindowError(str(exc)) from exc
        for name, value in checked.items():  # normalized once (frozen: set through object.__setattr__)
            object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> "WindowConfig":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)
