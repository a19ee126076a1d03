"""Exact patch: formed on this very antecedent sequence (one conditioned forward)."""

from .base import PatchKind


class ExactPatch(PatchKind):
    name = "exact"
    exact_on_prefix = True
