"""``contextdeque.replay.cost``: the cost model's address for the replay's users. It lives in
``contextdeque/scheduler/cost_model.py`` (the placement scheduler prices orders with it too, and
the scheduler sits below the replay)."""

from __future__ import annotations

from ..scheduler.cost_model import (
    CALIBRATION_VERSION,
    DEFAULTS,
    CostModel,
    calibration_dir,
    load_calibration,
    save_calibration,
)

__all__ = ["CALIBRATION_VERSION", "DEFAULTS", "CostModel", "calibration_dir", "load_calibration", "save_calibration"]
