"""Latency-first with every canonical computed while healing (``patch_policy="latency-shared"``).

The same critical path as ``latency`` (new content: one conditioned forward; re-reads: none),
but healing computes every new chunk's canonical (its patch is the difference: no second
forward) and the canonical of a chunk that left before it was healed. The store then holds each
chunk position-free as soon as the window is idle, for other windows and processes to reuse
(replicas sharing a Valkey store, a session reopened elsewhere) and for a recall that must not
forward. It costs one more forward per chunk in idle time than ``latency``, which computes a
canonical only when a re-read needs one.
"""

from __future__ import annotations

from .policy_latency import LatencyPolicy


class SharedLatencyPolicy(LatencyPolicy):
    name = "latency-shared"
    lazy_canonicals = False  # heal computes every canonical (see the module doc)

    def describe(self) -> str:
        return f"latency-shared({self.inner.describe()})"
