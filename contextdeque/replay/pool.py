"""The replay's records and its tier stack: :class:`ReplayConfig` (budgets), :class:`ReplayResult`
(what one run cost) and :class:`Pool` (the device KV pool under an eviction policy, spilling to a
host tier and disk). Deterministic: insertion-ordered containers only."""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from ..core.counters import Counters, shown
from ..scheduler.eviction import PoolEvictionPolicy
from ..window.config import WindowConfig
from ..window.plan import Load, Op
from ..scheduler.cost_model import CostModel

GiB = 1 << 30


@dataclass
class ReplayConfig:
    """Budgets: ``budget_tokens`` (the window; None: the trace's own slides only), ``device_bytes``
    and ``host_bytes`` (the KV pool tiers; disk is unbounded). ``rank``: patch rank m (None: the
    cost model's). ``overlap_loads``: canonicals read from host or disk load in parallel with the
    model's work of the same operation (encodes of misses, patch forms), as
    ``ContextWindow.extend`` does (MPIC): an admission then costs ``max(load, compute)`` instead of
    ``load + compute``. ``anticipate`` / ``recall_predictor``: price the window's idle-time
    anticipation (``replay/anticipate.py``; off by default: the replay's tables price the queued
    work only, as before; a window's default is on, ``WindowConfig.anticipate``)."""

    budget_tokens: int | None = None
    device_bytes: int = 16 * GiB
    host_bytes: int = 64 * GiB
    rank: int | None = None
    overlap_loads: bool = False
    anticipate: bool = False
    recall_predictor: str = WindowConfig.recall_predictor  # type: ignore[assignment]


def _seconds(v: float) -> float:
    return round(v, 6)


@dataclass
class ReplayResult(Counters):
    """What one run cost: the window's :class:`~contextdeque.core.counters.Counters` it predicts
    (forwards, tokens prefilled, encodes; patches as ``patch_forms`` / ``patch_hits``) and the
    replay's own counts. ``bytes`` per tier = bytes read + written there."""

    json_omit = frozenset({"patches_formed", "patches_reused"})  # (counted as patch_forms / patch_hits)

    trace: str
    placement: str
    eviction: str
    arm: str
    events: int = 0
    steps: int = 0
    queries: int = 0
    patch_forms: int = 0
    patch_hits: int = 0
    stale_keeps: int = 0
    refreshes: int = 0  # residents given new conditioning by the placement's staleness rule (store hits + forms)
    cascade_reforms: int = 0
    device_hits: int = 0
    device_misses: int = 0
    window_evictions: int = 0
    bytes: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    # bytes of KV computed and stored per tier (canonicals encoded, patches formed): the plan's
    # ``stored`` (``window.plan``), what the live window's receipts count the same way
    stored: dict[str, int] = field(default_factory=dict)
    patch_bytes: int = 0
    est_seconds: float = shown(_seconds, default=0.0)
    heal_tokens: int = 0  # latency-first: tokens prefilled while healing (idle time; inside tokens_prefilled)
    heal_forwards: int = 0
    heal_seconds: float = shown(_seconds, default=0.0)  # latency-first: idle-time work, not in est_seconds (the critical path)
    load_seconds: float = shown(_seconds, default=0.0)  # tier transfers (host/disk reads of canonicals) inside est_seconds
    overlap_saved_seconds: float = shown(_seconds, default=0.0)  # taken off est_seconds by overlapping loads with compute
    scheduler: dict[str, int] = field(default_factory=dict)


class Pool:
    """The device KV pool (eviction policy, byte budget) over a host tier (LRU) and disk."""

    def __init__(self, device_bytes: int, host_bytes: int, policy: PoolEvictionPolicy, cost: CostModel, r: ReplayResult,
                 do: Callable[[Op], None]) -> None:
        self.budget, self.host_budget = int(device_bytes), int(host_bytes)
        self.policy, self.cost, self.r = policy, cost, r
        self.do = do  # charges a planned operation (the engine's ``do``: a load from a slower tier)
        self.device: dict[Hashable, int] = {}
        self.used = 0
        self.host: OrderedDict[Hashable, int] = OrderedDict()
        self.host_used = 0
        self.disk: dict[Hashable, int] = {}
        self.pinned: Counter = Counter()
        self.i = 0
        self.log: list[Hashable] | None = None

    def access(self, key: Hashable, size: int) -> str | None:
        """Bring ``key`` to the device. Returns where it was (``device``/``host``/``disk``) or None
        (nowhere: the caller computes it; it is then stored on the device)."""
        i = self.i
        self.i += 1
        if self.log is not None:
            self.log.append(key)
        r = self.r
        if key in self.device:
            r.device_hits += 1
            self.policy.touch(key, size, i)
            return "device"
        r.device_misses += 1
        where = None
        if key in self.host:
            size = self.host.pop(key)
            self.host_used -= size
            r.bytes["host"] += size
            where = "host"
        elif key in self.disk:
            size = self.disk.pop(key)
            r.bytes["disk"] += size
            where = "disk"
        if where is not None:
            self.do(Load(str(key[-1]) if isinstance(key, tuple) else str(key), 0, tier=where, nbytes=size))
        self._make_room(size)
        self.device[key] = size
        self.used += size
        r.bytes["device"] += size
        self.policy.touch(key, size, i)
        return where

    def drop(self, key: Hashable) -> None:
        """Forget ``key``'s device copy (KV that was never made: a latency-first chunk's canonical
        when it leaves the window before healing computed it)."""
        size = self.device.pop(key, None)
        if size is not None:
            self.used -= size
            self.policy.remove(key)

    def _make_room(self, size: int) -> None:
        while self.used + size > self.budget:
            v = self.policy.victim(self.pinned)
            if v is None:
                return  # everything left is pinned by the window: over-commit
            vs = self.device.pop(v)
            self.used -= vs
            self.policy.remove(v)
            self.host[v] = vs
            self.host_used += vs
            self.r.bytes["host"] += vs
            while self.host_used > self.host_budget and self.host:
                k, s = self.host.popitem(last=False)
                self.host_used -= s
                self.disk[k] = s
                self.r.bytes["disk"] += s
