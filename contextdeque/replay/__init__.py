"""Offline replay of agent traces (issue 11): the cost model, its calibration, the engine that
runs a trace under a (placement, eviction, reuse arm) combination, parallel runs, fidelity mode
on a real window, plots and ``contextdeque replay`` / ``contextdeque calibrate``."""

from . import (  # noqa: F401  (register reuse cost rules)
    reuse_blind,
    reuse_cacheblend,
    reuse_epic,
    reuse_kvcapsule,
    reuse_kvselect,
    reuse_patch,
    reuse_patch_latency,
    reuse_patch_latency_shared,
    reuse_prefix_cache,
    reuse_reprefill,
    reuse_vlcache,
)
from ..scheduler.cost_model import DEFAULTS, CostModel, load_calibration, save_calibration
from .engine import ReplayConfig, Replayer, ReplayResult
from .reuse import REUSE_COSTS, ReuseCost, make_reuse

__all__ = ["CostModel", "DEFAULTS", "load_calibration", "save_calibration", "ReplayConfig", "Replayer", "ReplayResult",
           "REUSE_COSTS", "ReuseCost", "make_reuse"]
