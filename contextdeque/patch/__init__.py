"""Conditioning patches: every variant registers itself in ``PATCH_KINDS`` on import."""

from . import deep, exact, orbit, recall, removal, shared  # noqa: F401  (register kinds)
from .base import PATCH_KINDS, Patch, PatchKind, captured_energy, energy_rank, form_patch, rank_for_energy
from .keys import PATCH_KEY_VERSION, antecedent_signature, patch_key_parts, patch_signature
from .orbit import orderings
from .rank import FULL, resolve_rank
from .shared import SharedBasis

__all__ = ["Patch", "PatchKind", "PATCH_KINDS", "FULL", "resolve_rank", "form_patch", "antecedent_signature", "patch_signature", "patch_key_parts", "PATCH_KEY_VERSION", "energy_rank", "rank_for_energy", "captured_energy", "SharedBasis", "orderings"]
