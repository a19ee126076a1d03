"""`HostTier`: entries in CPU memory (optionally page-locked for fast device copies)."""

from __future__ import annotations

import torch

from contextdeque.stores.memory import MemoryTier
from contextdeque.stores.policy import EvictionPolicy


class HostTier(MemoryTier):
    """Entries as CPU tensors, budgeted in payload bytes.

    Args:
        budget_bytes: payload byte budget (None: unbounded).
        pin_memory: keep tensors in page-locked memory (only when CUDA is available), which
            makes host -> device promotion faster.
        policy: eviction policy name or instance.
        name: tier name used in `TierTraffic`.
    """

    kind = "host"

    def __init__(
        self,
        budget_bytes: int | None,
        *,
        pin_memory: bool = False,
        policy: str | EvictionPolicy = "lru",
        name: str = "host",
    ) -> None:
        super().__init__("cpu", budget_bytes, policy=policy, name=name)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()

    def _place(self, t: torch.Tensor, copy: bool) -> torch.Tensor:
        if self.pin_memory:
            if not copy and t.device.type == "cpu" and t.is_pinned():
                return t
            # pin_memory() always copies into a fresh page-locked buffer.
            return t.to("cpu").pin_memory()
        return super()._place(t, copy)
