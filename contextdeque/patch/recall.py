"""Fresh recall patch: formed on the context that now precedes a recalled chunk.

Same measurement as the exact patch; its own kind so stores and receipts can tell a recall from a
first placement, and so a stale patch (frozen at eviction) is never mistaken for it.
"""

from .base import PatchKind


class RecallPatch(PatchKind):
    name = "recall"
    stored_as = "exact"  # the same measurement as an exact patch on the same antecedents
    exact_on_prefix = True
