"""The placement scheduler (issue 11) and eviction policies.

``SchedulerPlacement`` (``placement="scheduler"`` on a ``ContextWindow``, and a replay policy)
orders and admits chunks so stored patches stay valid; ``PatchGraph`` (``window/graph.py``) is the
networkx index of stored patches it searches; ``exact`` / ``heuristic`` / ``brute_force`` the searches.
(Eviction policies, ``lru``, ``reuse-distance``, ``belady``, are the stores' one family:
``contextdeque.stores.EvictionPolicy``.)
"""

from ..core.errors import PolicyError
from .cost import DEFAULT_WEIGHTS, FORMS_WEIGHTS, SECONDS_WEIGHTS, OrderCost, Weights, order_cost
from .placement import OfflineSchedulerPlacement, SchedulerPlacement
from .placement_valid import ValidPlacement
from .search import EXACT_MAX_CHUNKS, brute_force, exact, heuristic, schedule
from ..window.graph import PatchGraph  # (its one home: window/graph.py, beside the window's conditioning graph)

__all__ = [
    "SchedulerPlacement", "OfflineSchedulerPlacement", "ValidPlacement", "PatchGraph", "Weights", "DEFAULT_WEIGHTS", "FORMS_WEIGHTS", "SECONDS_WEIGHTS", "OrderCost",
    "order_cost", "exact", "heuristic", "brute_force", "schedule", "EXACT_MAX_CHUNKS", "PolicyError",
]
