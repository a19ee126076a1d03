"""``contextdeque replay-bench``: replay throughput per policy, scheduler vs arrival order, the
heuristic over the exact search, and a Mooncake trace under every policy
(``contextdeque.replay.bench``)."""

from __future__ import annotations

from ..replay.bench import add_arguments, run

__all__ = ["add_arguments", "run"]
