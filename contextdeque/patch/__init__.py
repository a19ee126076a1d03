"""Conditioning patches: every variant registers itself in ``PATCH_KINDS`` on import."""

from . import deep, exact, orbit, recall, removal, shared  # noqa: F401  (register kinds)
from .alloc import ON_MISS, Allocation, FidelityRule, LayerSensitivity, allocate_ranks, fidelity_report
from .base import PATCH_KINDS, Patch, PatchKind, form_patch
from .keys import PATCH_KEY_VERSION, antecedent_signature, patch_key_parts, patch_signature
from .orbit import orderings
from .rank import FULL, resolve_rank
from .shared import SharedBasis

__all__ = ["Patch", "PatchKind", "PATCH_KINDS", "FULL", "resolve_rank", "form_patch", "antecedent_signature", "patch_signature", "patch_key_parts", "PATCH_KEY_VERSION", "allocate_ranks", "Allocation", "FidelityRule", "LayerSensitivity", "ON_MISS", "fidelity_report", "SharedBasis", "orderings"]
