"""Blind reuse: canonicals relocated, no conditioning patches, nothing recomputed."""

from .reuse import ReuseCost


class BlindCost(ReuseCost):
    name = "blind"
    window_policy = "none"
