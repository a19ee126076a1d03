"""WindowContext: everything a window and its forks share, in one explicit object.

The backend (with the window's root), the store adapter, the patch policy and placement made
from the settings (:class:`~.config.WindowConfig`), and the cost counters. A fork shares its parent's context (same
canonicals, same store, same policy); what differs between them is their ``WindowState``.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..core.cooperative import in_background
from ..core.counters import Counters, adds
from ..model.envelope import load_envelope
from ..patch.alloc import FidelityRule
from ..patch.rank import FULL, resolve_rank
from .graph import PatchGraph
from .config import DEFAULT_MAX_EVICTED, OVERFLOW_POLICIES, WindowConfig  # noqa: F401  (re-exported)
from .policy import PatchPolicy
from .prepared import PreparedForwards
from .store import WindowStore

if TYPE_CHECKING:  # pragma: no cover
    from ..model.hf import HFBackend

SETTINGS = frozenset(f.name for f in dataclasses.fields(WindowConfig))  # what a context reads off its config
BACKEND_FACTS = frozenset({"layout", "fingerprint", "root_len"})  # what a context reads off its backend
PATCH_INDEX_CHUNKS = 4096  # chunks the stored-prefix hint remembers (WindowContext.note_stored_prefix)
PATCH_INDEX_PREFIXES = 32  # prefixes it remembers per chunk


@dataclass(kw_only=True)
class FamilyCounters(Counters):
    """What a window family counts itself, beside its backend's :class:`~contextdeque.core.counters.Counters`:
    ``encodes`` (chunks encoded), ``decode_forwards`` / ``decode_tokens`` (forwards the window ran
    itself for decoding), ``vision_encodes`` (vision tower runs). A family's forwards and tokens are
    the backend's plus the decode ones (:meth:`WindowContext.total_forwards`); its patches are
    counted per operation (``Receipt``)."""

    json_omit = frozenset({"forwards", "tokens_prefilled", "patches_formed", "patches_reused"})  # (counted elsewhere)

    decode_forwards: int = adds()
    decode_tokens: int = adds()
    vision_encodes: int = adds()


@dataclass
class WindowContext:
    """Shared configuration and counters of a window family (a window and its forks).

    ``counters``: what the family counts itself (:class:`FamilyCounters`: encodes, decode forwards
    and tokens beside the backend's own ``counters``, vision tower runs).
    ``expected_reuse``: ``ref -> float``, how often a chunk is expected to be read again (a
    scheduler may set it; healing order is staleness x expected reuse). None: 1 for every chunk.

    Foreground operations and the idle healer take turns on the model through ``op_lock``:
    a foreground operation announces itself (``foreground()``), and background work gives way
    at its next checkpoint (``contextdeque.core.cooperative``).
    """

    backend: "HFBackend"
    store: WindowStore
    policy: PatchPolicy
    config: WindowConfig  # the settings (validated once, when the WindowConfig was made)
    counters: FamilyCounters = field(default_factory=FamilyCounters)
    expected_reuse: Callable[..., float] | None = None
    placement: Any = None  # a window.placement.PlacementPolicy (None: arrival order)
    # where a recall the agent does not pin goes (config.recall_placement; None: as ``placement``)
    recall_placement: Any = None
    # chunk id -> antecedent id tuples whose patch was stored (a placement hint): bounded, see note_stored_prefix
    patch_index: PatchGraph = field(
        default_factory=lambda: PatchGraph(max_contents=PATCH_INDEX_CHUNKS, max_prefixes=PATCH_INDEX_PREFIXES), repr=False)
    # store keys of the patches anticipation formed (window.anticipation): receipts say "anticipated"
    anticipated_keys: set = field(default_factory=set, repr=False)
    # provisional chunks' conditioned forwards anticipation ran for the next step (window.prepared)
    prepared: PreparedForwards = field(default_factory=PreparedForwards, repr=False)
    # the family's recall predictor (window.predictor), made from config.recall_predictor on first use
    predictor: Any = field(default=None, repr=False)
    # the family's reorders so far, as index permutations (``perm[i]``: the old index of the chunk
    # now at i) with counts: what reorder anticipation learns its probabilities from
    reorders_seen: "Counter[tuple[int, ...]]" = field(default_factory=Counter, repr=False)
    op_lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _waiting: list[int] = field(default_factory=lambda: [0], repr=False)
    _waiting_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _fidelity_rule: "FidelityRule | None" = field(default=None, repr=False)
    last_foreground: float = field(default_factory=time.monotonic, repr=False)
    foreground_waits_ms: deque = field(default_factory=lambda: deque(maxlen=1000), repr=False)

    def note_stored_prefix(self, chunk_id: str, prefix: tuple[str, ...]) -> None:
        """Record that ``chunk_id``'s patch on ``prefix`` is stored (the placement scheduler's
        hint). A hint only, so bounded: the ``PATCH_INDEX_CHUNKS`` most recently noted chunks,
        ``PATCH_INDEX_PREFIXES`` prefixes each (least recent forgotten)."""
        self.patch_index.add(chunk_id, prefix)

    @contextmanager
    def foreground(self) -> Iterator[None]:
        """Hold the model for a foreground operation (background work yields to it)."""
        background = in_background()
        t0 = time.perf_counter()
        with self._waiting_lock:
            self._waiting[0] += 1
        try:
            self.op_lock.acquire()
        finally:
            with self._waiting_lock:
                self._waiting[0] -= 1
        if not background:  # how long the foreground waited for the model (e.g. for the healer)
            self.foreground_waits_ms.append((time.perf_counter() - t0) * 1000.0)
        try:
            yield
        finally:
            if not background:
                self.last_foreground = time.monotonic()
            self.op_lock.release()

    def foreground_waiting(self) -> bool:
        """A foreground operation is waiting for the model."""
        return self._waiting[0] > 0

    def __getattr__(self, name: str) -> Any:
        """The settings (``ctx.rank``, ``ctx.budget_tokens``, ``ctx.on_miss``...), read through the
        config: one source (a fork shares its parent's); see :class:`~.config.WindowConfig`. And
        the backend's ``layout``, ``fingerprint`` and ``root_len``."""
        if name in SETTINGS:
            return getattr(self.config, name)
        if name in BACKEND_FACTS:
            return getattr(self.backend, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def total_forwards(self) -> int:
        return int(self.backend.forwards_run) + self.counters.decode_forwards

    def total_tokens(self) -> int:
        return int(self.backend.tokens_prefilled) + self.counters.decode_tokens

    @property
    def fidelity_rule(self) -> "FidelityRule | None":
        """The rule every patch is formed under when ``fidelity_target`` is set: the target (an η)
        through the model's calibrated envelope (``contextdeque calibrate``; cached per model
        fingerprint) — read as an energy when the model has none — under the byte cap, with
        ``on_miss``. None without a target."""
        if self.fidelity_target is None:
            return None
        if self._fidelity_rule is None:
            self._fidelity_rule = FidelityRule.for_target(
                float(self.fidelity_target), load_envelope(self.fingerprint), float(self.max_patch_fraction), self.on_miss,
                precisions=tuple(self.patch_precisions))
        return self._fidelity_rule

    def formation_ranks(self, rank: int | str, n_tokens: int) -> tuple[int, int]:
        """(rank_k, rank_v) a patch of a chunk of ``n_tokens`` is formed at (and keyed by): under a
        fidelity target every direction (the allocation then cuts it per layer), else ``rank``
        clamped (:meth:`clamp_rank`). A full-rank ask stays full rank either way."""
        return self.clamp_rank(FULL if self.fidelity_target is not None else rank, n_tokens)

    def clamp_rank(self, rank: int | str, n_tokens: int) -> tuple[int, int]:
        """(rank_k, rank_v) for a chunk of ``n_tokens``: ``"full"`` or anything above
        ``min(T, H*d)`` becomes that cap (a chunk shorter than m cannot hold a rank-m patch)."""
        lay = self.layout
        return (resolve_rank(rank, n_tokens, lay.k_heads * lay.k_dim, "K", clamp=True),
                resolve_rank(rank, n_tokens, lay.v_heads * lay.v_dim, "V", clamp=True))


def foreground_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a window method as a foreground operation (the idle healer gives way to it)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._ctx.foreground():
            return method(self, *args, **kwargs)

    return wrapper
