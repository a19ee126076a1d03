"""The connector runtime's counters (``Runtime.stats``): named floats that the vLLM scheduler
thread and the connector's loading thread both add to, under one lock (no vLLM import here, so
the counting is tested without vLLM)."""

from __future__ import annotations

import threading
from collections import defaultdict


class RuntimeStats(defaultdict):
    """``name -> float`` (0.0 when never counted); read like a dict, written only through
    :meth:`count` and :meth:`count_max`, which hold the one lock (a ``+=`` from two threads loses
    updates)."""

    def __init__(self) -> None:
        super().__init__(float)
        self._lock = threading.Lock()

    def count(self, **amounts: float) -> None:
        """Add each of ``amounts`` to its counter."""
        with self._lock:
            for name, amount in amounts.items():
                self[name] += amount

    def count_max(self, name: str, value: float) -> None:
        """Raise counter ``name`` to ``value`` if that is larger."""
        with self._lock:
            self[name] = max(self[name], value)
