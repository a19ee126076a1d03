"""`MemoryTier`: entries held as tensors on one torch device (e.g. ``cuda:0``)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from contextdeque.core.errors import ArgumentTypeError, StoreCapacityError, StoreConfigError
from contextdeque.stores.base import EntryStat, Evicted, Expect, PutRequest, PutResult, StoreEntry, Tier, check_collision
from contextdeque.stores.policy import EvictionPolicy


@dataclass
class _Slot:
    entry: StoreEntry
    last_used: int
    priority: int


def tier_device(device: object) -> torch.device:
    """``device`` as a torch device that exists on this machine, refused up front (not at the
    first put) with a typed error naming the argument."""
    if not isinstance(device, (str, torch.device)):
        raise ArgumentTypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise StoreConfigError(f"device {device!r} is not a torch device: {e}") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise StoreConfigError(f"device {device!r} does not exist here ({n} CUDA device(s) visible)")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise StoreConfigError(f"device {device!r} does not exist here (MPS unavailable)")
    return dev


class MemoryTier(Tier):
    """Entries as tensors on ``device``, budgeted in payload bytes.

    ``put`` copies tensors onto the device (so later in-place changes by the caller never
    reach the store); ``get`` returns the tier's own tensors, to be treated as read-only.

    Args:
        device: where tensors live (``"cuda:0"``, ``"cpu"``, ...).
        budget_bytes: payload byte budget (None: unbounded).
        policy: eviction policy name or instance (``"lru"``, ``"priority"``).
        name: tier name used in `TierTraffic` (unique within a `TieredStore`).
    """

    kind = "memory"

    def __init__(
        self,
        device: str | torch.device,
        budget_bytes: int | None,
        *,
        policy: str | EvictionPolicy = "lru",
        name: str = "device",
    ) -> None:
        super().__init__(name=name, budget_bytes=budget_bytes, policy=policy)
        self.device = tier_device(device)
        self._slots: dict[str, _Slot] = {}
        self._pins: set[str] = set()
        self._clock = itertools.count(1)
        self._used = 0
        self._reserved: dict[str, int] = {}  # owner -> bytes of the budget set aside (see `reserve`)

    # budget shared with memory kept outside the tier -------------------------------------

    def reserve(self, owner: str, nbytes: int) -> None:
        """Set aside ``nbytes`` of the budget for memory that ``owner`` keeps outside the tier on
        the same device (a window's placed pages: `WindowStore.reserve_working_set`), so the
        tier and its users together stay within the budget; ``nbytes=0`` gives it back. The
        tier does not shrink at once: entries over the smaller budget go at the next put."""
        with self._lock:
            if nbytes > 0:
                self._reserved[owner] = int(nbytes)
            else:
                self._reserved.pop(owner, None)

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the budget set aside by `reserve`."""
        with self._lock:
            return sum(self._reserved.values())

    def _room(self) -> int | None:
        """The budget left to entries: the budget less what is reserved (None: unbounded)."""
        if self._budget is None:
            return None
        return max(0, self._budget - sum(self._reserved.values()))

    # storage hooks (HostTier overrides _place) -----------------------------------------

    def _place(self, t: torch.Tensor, copy: bool) -> torch.Tensor:
        """The tier's copy of ``t`` on its device."""
        if not copy and t.device == self.device:
            return t
        return t.to(self.device, copy=True)

    # what the tier implements ------------------------------------------------------------

    def _read(self, key: str, expect: Expect, corrupt_ok: bool) -> StoreEntry | None:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                return None
            expect.check(key, slot.entry.meta)
            slot.last_used = next(self._clock)
            return slot.entry

    def peek(self, key: str) -> Mapping[str, str] | None:
        with self._lock:
            slot = self._slots.get(key)
            return None if slot is None else slot.entry.meta

    def _write(self, key: str, entry: StoreEntry, request: PutRequest) -> PutResult:
        with self._lock:
            old = self._slots.get(key)
            if old is not None and not request.overwrite and check_collision(key, old.entry.meta, entry.meta):
                old.last_used = next(self._clock)
                if request.pinned:
                    self._pins.add(key)
                return PutResult(stored=False)
            need = entry.nbytes
            room = self._room()
            if room is not None and need > room:
                raise StoreCapacityError(
                    f"entry {key!r} ({need} B) exceeds tier {self.name!r}'s budget ({self._budget} B"
                    + (f", of which {self._budget - room} B reserved by its users)" if room < self._budget else ")")
                )
            freed_by_replace = old.entry.nbytes if old is not None else 0
            victims = self._choose_victims(key, need - freed_by_replace)
            # Copy before evicting: a failing device copy must leave the tier unchanged.
            stored = entry.with_tensors({n: self._place(t, request.copy) for n, t in entry.tensors.items()})
            evicted = []
            for v in victims:
                vslot = self._slots.pop(v)
                self._used -= vslot.entry.nbytes
                evicted.append(Evicted(v, vslot.entry.nbytes, vslot.priority, vslot.entry))
            if old is not None:
                self._slots.pop(key)
                self._used -= old.entry.nbytes
            self._slots[key] = _Slot(stored, next(self._clock), request.priority)
            self._used += stored.nbytes
            if request.pinned:
                self._pins.add(key)
            return PutResult(stored=True, evicted=tuple(evicted))

    def _choose_victims(self, key: str, need: int) -> list[str]:
        """Keys to evict so that ``need`` more bytes fit; raises if impossible."""
        room = self._room()
        over = self._used + need - room if room is not None else 0
        if over <= 0:
            return []
        cands = [
            EntryStat(k, s.entry.nbytes, s.last_used, s.priority)
            for k, s in self._slots.items()
            if k != key and k not in self._pins
        ]
        usage = f"{self._used} B used of {room} B (budget {self._budget} B less {self._budget - room} B reserved)"
        return self.choose_victims(key, over, cands, usage)

    def delete(self, key: str) -> bool:
        with self._lock:
            self._pins.discard(key)
            slot = self._slots.pop(key, None)
            if slot is None:
                return False
            self._used -= slot.entry.nbytes
            return True

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._slots

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._slots)

    def nbytes(self) -> int:
        with self._lock:
            return self._used

    def priority_of(self, key: str) -> int:
        with self._lock:
            slot = self._slots.get(key)
            return 0 if slot is None else slot.priority

    def pin(self, key: str) -> bool:
        with self._lock:
            if key not in self._slots:
                return False
            self._pins.add(key)
            return True

    def unpin(self, key: str) -> bool:
        with self._lock:
            if key in self._pins:
                self._pins.discard(key)
                return True
            return False

    def is_pinned(self, key: str) -> bool:
        with self._lock:
            return key in self._pins
