"""The window: an agent's context as a deque of position-free KV chunks (issue 4).

``ContextWindow`` (``window.py``) is the public entry point; the rest are its single-purpose
parts: ``ref`` (ChunkRef), ``receipt`` (Receipt, Meter), ``slot`` (placed chunks),
``state`` (a window's own state), ``context`` (what a window family shares), ``store``
(the window's view of a TieredStore), ``root``,
``policy`` + ``policy_*`` (patch policies, one file each), ``predictor`` + ``predictor_*``
(recall predictors for anticipation, one file each), ``reconcile`` (the re-conditioning
pass), ``graph`` (the conditioning graph and recall cascades), ``decode`` (materialize,
transformers interop, decoding), ``disposable`` (the disposability test), ``bench``
(``contextdeque window-bench``), ``kvselect`` (decode-aware KV selection and its window policy).
"""

from . import policy_default, policy_exact, policy_latency, policy_latency_shared, policy_none  # noqa: F401  (register policies)
from . import predictor_recency, predictor_session  # noqa: F401  (register recall predictors)
from .config import DEFAULT_RANK, WindowConfig
from .graph import CASCADE_POLICIES, Cascade, ConditioningGraph
from .placement import PLACEMENT_POLICIES, ArrivalPlacement, PlacementPolicy, PlacementView, make_placement
from .kvselect import SELECTORS, KVSelector, SelectionPolicy, make_selector
from .policy import PATCH_POLICIES, Decision, PatchPolicy, make_policy
from .policy_default import DefaultPolicy
from .policy_exact import ExactPolicy
from .policy_latency import LatencyPolicy
from .policy_latency_shared import SharedLatencyPolicy
from .policy_none import NonePolicy
from .predictor import RECALL_PREDICTORS, Prediction, RecallPredictor, make_predictor
from .receipt import Receipt
from .ref import ChunkRef
from .store import WindowStore, default_store
from .window import Answer, ContextWindow, Verdict

__all__ = [
    "ContextWindow",
    "WindowConfig",
    "DEFAULT_RANK",
    "ChunkRef",
    "Receipt",
    "Verdict",
    "Answer",
    "Cascade",
    "ConditioningGraph",
    "CASCADE_POLICIES",
    "PatchPolicy",
    "Decision",
    "PATCH_POLICIES",
    "DefaultPolicy",
    "ExactPolicy",
    "LatencyPolicy",
    "NonePolicy",
    "make_policy",
    "PlacementPolicy",
    "PlacementView",
    "ArrivalPlacement",
    "PLACEMENT_POLICIES",
    "make_placement",
    "WindowStore",
    "default_store",
    "SELECTORS",
    "KVSelector",
    "SelectionPolicy",
    "make_selector",
    "RECALL_PREDICTORS",
    "RecallPredictor",
    "Prediction",
    "make_predictor",
]
