"""The replay's records and its tier stack: :class:`ReplayConfig` (budgets), :class:`ReplayResult`
(what one run cost) and :class:`Pool` (the stores' one tier policy over keys and sizes: device,
host, disk). Deterministic: insertion-ordered containers only."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Hashable

from ..core.counters import Counters, shown
from ..core.errors import PolicyError
from ..stores import POLICIES, EvictionPolicy, TierTraffic, key_stack, sized_entry
from ..window.config import WindowConfig
from ..window.plan import Load, Op

GiB = 1 << 30

#: the eviction policies ``replay --eviction`` offers: the stores' family, less those that order by
#: what the replay's entries do not carry (``EvictionPolicy.replayed``)
REPLAY_EVICTIONS: tuple[str, ...] = tuple(sorted(n for n, cls in POLICIES.items() if cls.replayed))


def make_eviction(spec: "str | EvictionPolicy") -> EvictionPolicy:
    """A fresh eviction policy for one replay (the stores' `EvictionPolicy` family)."""
    return POLICIES.make(spec, instance_of=EvictionPolicy, error=PolicyError)


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
    # the tier stack's reads, writes and evictions per tier (``TierTraffic``, as a live store counts them)
    traffic: dict[str, dict[str, int]] = field(default_factory=dict)
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
    """The replay's tier stack: the stores' one tier policy (`TieredStore`, run over key tiers:
    ``stores/keytier.py``) with the device budget (its eviction policy, told every access), the
    host budget and an unbounded disk, and the live `WindowStore`'s holds: an entry is held while
    window slots hold it, and demoted one tier when its last holder lets go. Canonicals and
    patches are entries; every read, write and eviction is counted per tier (`TierTraffic`).
    ``provisional(resident)``: whether the resident has no canonical yet; its slot's claim on its
    canonical waits until it has one (``WindowState.held_keys`` leaves a provisional slot's chunk
    out), and is then held, brought up if it was spilled meanwhile, as the window's ``hold`` does
    at the end of the operation that computed it."""

    def __init__(self, device_bytes: int, host_bytes: int, policy: EvictionPolicy, r: ReplayResult,
                 do: Callable[[Op], None], provisional: Callable[[str], bool] = lambda resident: False) -> None:
        self.store = key_stack([("device", int(device_bytes)), ("host", int(host_bytes)), ("disk", None)], policy)
        self.top = self.store.tiers[0].name
        self.policy, self.r = policy, r
        self.do = do  # charges a planned operation (the engine's ``do``: a load from a slower tier)
        self.traffic = TierTraffic()
        #: the window's slots holding each key (decisions read it: resident or not)
        self.pinned: Counter = Counter()
        #: every window's and fork's holds, as ``WindowStore`` counts them (what decides demotion)
        self.holds: Counter = Counter()
        self.provisional = provisional
        #: claims on canonicals of residents with none yet: not held until computed (``provisional``)
        self._waiting: Counter = Counter()
        self._changes: dict[Hashable, int] = {}  # the operation's net holds per key, until `install`
        self._holder: dict[Hashable, str] = {}  # key -> the resident whose slot held or let go of it last
        self._positions: dict[str, int] = {}  # resident -> index, as the last operation left the window
        #: resident -> the store key of the patch its slot holds (a slot holds its canonical and its patch)
        self.slot_patch: dict[str, Hashable] = {}
        self.simulating = False  # anticipation's simulations hold nothing (the live one installs nothing)
        self.i = 0
        self.log: list[str] | None = None

    def _touch(self, key: str, size: int) -> None:
        """One access of the run's access sequence (what an offline policy was given)."""
        if self.log is not None:
            self.log.append(key)
        self.policy.touch(key, size, self.i)
        self.i += 1

    def access(self, key: Hashable, size: int, *, store: bool = True, load: bool = True) -> str | None:
        """Read ``key`` (promoted to the device by copy, as a store hit is). Returns the tier that
        served it, or None (nowhere: the caller computes it; with ``store`` it is then written).
        ``load``: a hit below the device is a ``Load`` of the plan (a canonical's, as the window's)."""
        skey = store_key(key)
        self._touch(skey, size)
        tr = TierTraffic()
        entry = self.store.get(skey, traffic=tr)
        self.traffic += tr
        where = tr.served_from
        if where == self.top:
            self.r.device_hits += 1
            return where
        self.r.device_misses += 1
        if entry is not None:
            if load:
                self.do(Load(str(key[-1]) if isinstance(key, tuple) else str(key), 0, tier=where, nbytes=entry.nbytes))
            return where
        if store:
            self.store.put(skey, sized_entry(size, _kind(key)), traffic=self.traffic)
        return None

    def write(self, key: Hashable, size: int, *, read_back: bool = False) -> str:
        """Store ``key`` (computed: an encode, a formed patch) where the tier policy admits it;
        ``read_back``: then read it, as the window reads a canonical it just encoded. Returns the
        tier it landed in, as the window's plan records a stored entry (``WindowStore.tier_of``
        after the put: below the device when the device cannot take it)."""
        skey = store_key(key)
        self._touch(skey, size)
        self.store.put(skey, sized_entry(size, _kind(key)), traffic=self.traffic)
        where = self.store.where(skey)
        if read_back:
            self.store.get(skey, traffic=self.traffic)
        return where[0] if where else "none"

    def contains(self, key: Hashable) -> bool:
        return self.store.contains(store_key(key))

    def drop(self, key: Hashable) -> None:
        """Forget ``key`` (KV that was never made: a latency-first chunk's canonical when it leaves
        the window before healing computed it)."""
        self.store.delete(store_key(key))

    def hold(self, key: Hashable, resident: str) -> None:
        """``resident``'s slot holds ``key`` (the store sees it at `install`)."""
        self.pinned[key] += 1
        self._change(key, resident, 1)

    def release(self, key: Hashable, resident: str) -> None:
        """``resident``'s slot lets go of ``key`` (the store sees it at `install`)."""
        self.pinned[key] -= 1
        if self.pinned[key] <= 0:
            del self.pinned[key]
        self._change(key, resident, -1)

    def _change(self, key: Hashable, resident: str, n: int) -> None:
        if not self.simulating:
            self._changes[key] = self._changes.get(key, 0) + n
            self._holder[key] = resident

    def _slot_order(self, keys: list[Hashable], order: "dict[str, int]") -> list[Hashable]:
        """``keys`` as a window's ``held_keys`` lists them: slot by slot (``order``: resident ->
        index), a slot's canonical before its patch."""
        last = len(order)
        return sorted(keys, key=lambda k: (order.get(self._holder.get(k, ""), last), _kind(k) != "chunk"))

    def install(self, order: "list[str]", released_from: "list[str] | None" = None) -> None:
        """A window operation ends (``ContextWindow._install``) with the window in ``order``: the
        keys its slots now hold more are held (``WindowStore.hold``: a first hold brings a key
        below the top up), then those they hold less are let go and a key nobody holds any more is
        demoted one tier (``WindowStore.release``), both in the slots' order (the new one, the one
        the operation started from: ``released_from``, else the order the last one left)."""
        changes, self._changes = self._changes, {}
        now = {r: i for i, r in enumerate(order)}
        before = self._positions if released_from is None else {r: i for i, r in enumerate(released_from)}
        self._positions = now
        for key in [k for k, n in changes.items() if n < 0 and k in self._waiting]:  # (never held: nothing to let go)
            let_go = min(self._waiting[key], -changes[key])
            self._waiting[key] -= let_go
            changes[key] += let_go
            if self._waiting[key] <= 0:
                del self._waiting[key]
        held: dict[Hashable, int] = {}
        for key, n in changes.items():
            if n > 0 and _kind(key) == "chunk" and self.provisional(self._holder.get(key, "")):
                self._waiting[key] += n
            elif n > 0:
                held[key] = n
        for key in [k for k in self._waiting if not self.provisional(self._holder.get(k, ""))]:
            held[key] = held.get(key, 0) + self._waiting.pop(key)  # its canonical is computed: held now
        for key in self._slot_order(list(held), now):
            first = self.holds[key] == 0
            self.holds[key] += held[key]
            where = self.store.where(store_key(key)) if first else ()
            if where and where[0] != self.top:
                self.store.get(store_key(key), traffic=self.traffic)  # promotes
        for key in self._slot_order([k for k, n in changes.items() if n < 0], before):
            self.holds[key] += changes[key]
            if self.holds[key] <= 0:
                del self.holds[key]
                self.store.demote(store_key(key), traffic=self.traffic)

    def condition(self, resident: str, patch: Hashable | None) -> None:
        """``resident``'s slot now holds ``patch`` (None: no stored patch, its canonical or its own
        forward's KV), letting go of the one it held (what ``ContextWindow._install`` does)."""
        old = self.slot_patch.pop(resident, None)
        if patch is not None:
            self.slot_patch[resident] = patch
            self.hold(patch, resident)
        if old is not None:
            self.release(old, resident)

    def snapshot(self) -> tuple[Counter, dict[str, Hashable]]:
        """The window's slots' holds and patches (a fork's parent, a simulation's start)."""
        return Counter(self.pinned), dict(self.slot_patch)

    def restore(self, saved: tuple[Counter, dict[str, Hashable]]) -> None:
        self.pinned, self.slot_patch = Counter(saved[0]), dict(saved[1])

    def fork(self, order: "list[str]") -> tuple[Counter, dict[str, Hashable]]:
        """A fork of the window in ``order`` holds what its parent's slots hold
        (``WindowStore.hold`` of the fork's keys); returns the parent's slots (`snapshot`)."""
        parent = self.snapshot()
        for key, n in parent[0].items():
            if not self.simulating:
                self._changes[key] = self._changes.get(key, 0) + n
        self.install(order)
        return parent

    def end_fork(self, parent: tuple[Counter, dict[str, Hashable]], *, committed: bool, order: "list[str]",
                 parent_order: "list[str]") -> None:
        """A commit lets go of the parent's holds (the fork's slots, in ``order``, stay), a discard
        of the fork's (the parent's slots, in ``parent_order``, come back)."""
        let_go = parent[0] if committed else Counter(self.pinned)
        if not committed:
            self.restore(parent)
        for key, n in let_go.items():
            self._changes[key] = self._changes.get(key, 0) - n
        self.install(order if committed else parent_order, released_from=parent_order if committed else order)

    def settle(self) -> None:
        """The run's tier traffic into its result: ``bytes`` (read + written per tier) and
        ``traffic`` (reads, writes and evictions per tier)."""
        tr, r = self.traffic, self.r
        for tier in (t.name for t in self.store.tiers):
            r.bytes[tier] = r.bytes.get(tier, 0) + tr.read.get(tier, 0) + tr.written.get(tier, 0)
        r.traffic = {"read": dict(tr.read), "written": dict(tr.written), "evicted": dict(tr.evicted)}


def store_key(key: Hashable) -> str:
    """The replay's entry key as a store key: ``("c", content)`` -> ``"c/<content>"``."""
    return "/".join(map(str, key)) if isinstance(key, tuple) else str(key)


def _kind(key: Hashable) -> str:
    return {"c": "chunk", "p": "patch", "pfx": "prefix"}.get(key[0], "entry") if isinstance(key, tuple) else "entry"
