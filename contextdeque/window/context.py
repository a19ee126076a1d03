"""WindowContext: everything a window and its forks share, in one explicit object.

The backend (with the window's root), the store adapter, the patch policy, the rank, the
budget, the cascade policy and the cost counters. A fork shares its parent's context (same
canonicals, same store, same policy); what differs between them is their ``WindowState``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..errors import BudgetError, WindowError
from .graph import CASCADE_POLICIES
from .policy import PatchPolicy
from .store import WindowStore

if TYPE_CHECKING:  # pragma: no cover
    from ..backends.hf import HFBackend

OVERFLOW_POLICIES = ("slide", "error")


@dataclass
class WindowContext:
    """Shared configuration and counters of a window family (a window and its forks).

    ``counters``: ``encodes`` (chunks encoded by this family), ``decode_forwards`` /
    ``decode_tokens`` (forwards the window ran itself for decoding, beside the backend's own
    ``forwards_run`` / ``tokens_prefilled``).
    """

    backend: "HFBackend"
    store: WindowStore
    policy: PatchPolicy
    rank: int
    budget_tokens: int | None
    cascade_policy: str
    overflow: str
    storage: torch.dtype
    counters: dict[str, int] = field(default_factory=lambda: {"encodes": 0, "decode_forwards": 0, "decode_tokens": 0})

    def __post_init__(self) -> None:
        if self.cascade_policy not in CASCADE_POLICIES:
            raise WindowError(f"cascade_policy must be one of {CASCADE_POLICIES}, got {self.cascade_policy!r}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise WindowError(f"overflow must be one of {OVERFLOW_POLICIES}, got {self.overflow!r}")
        if self.budget_tokens is not None and int(self.budget_tokens) < 1:
            raise BudgetError(f"budget_tokens must be >= 1 (or None for no budget), got {self.budget_tokens}")
        if int(self.rank) < 0:
            raise WindowError(f"rank must be >= 0, got {self.rank}")

    @property
    def layout(self):
        return self.backend.layout

    @property
    def fingerprint(self) -> str:
        return self.backend.fingerprint

    @property
    def root_len(self) -> int:
        return self.backend.root_len

    def total_forwards(self) -> int:
        return int(self.backend.forwards_run) + self.counters["decode_forwards"]

    def total_tokens(self) -> int:
        return int(self.backend.tokens_prefilled) + self.counters["decode_tokens"]

    def clamp_rank(self, rank: int | str, n_tokens: int) -> tuple[int, int]:
        """(rank_k, rank_v) for a chunk of ``n_tokens``: ``"full"`` or anything above
        ``min(T, H*d)`` becomes that cap (a chunk shorter than m cannot hold a rank-m patch)."""
        lay = self.layout
        cap_k = min(n_tokens, lay.k_heads * lay.k_dim)
        cap_v = min(n_tokens, lay.v_heads * lay.v_dim)
        if rank == "full":
            return cap_k, cap_v
        r = int(rank)
        return min(r, cap_k), min(r, cap_v)
