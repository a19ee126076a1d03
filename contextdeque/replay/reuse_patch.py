"""contextdeque's patch arm: canonicals relocated plus rank-m conditioning patches formed (one
conditioned forward each) or served by the store, as the window's default patch policy decides."""

from .reuse import ReuseCost


class PatchCost(ReuseCost):
    name = "patch"
    window_policy = "eager"
