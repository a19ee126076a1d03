"""The cost model: what a forward, a patch, a page and a tier transfer cost on one backend, in seconds.

One price list for every planned operation (``window.plan``): the replay charges a trace's plan by
it, and the placement scheduler prices a candidate order by it (``scheduler/cost.py``). It lives
here, below the replay, so the scheduler may import it; ``contextdeque.replay.cost`` re-exports it.

Constants come from ``contextdeque calibrate`` (measured on this machine's backend and saved under
the cache directory with the model fingerprint), or from :data:`DEFAULTS` (the default model's
geometry with round CPU figures) when no calibration is found; the replay says which it used.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

from ..patch.rank import DEFAULT_RANK
from ..window.plan import Difference, Encode, Form, Forward, Load, Op

CALIBRATION_VERSION = 1


@dataclass(frozen=True)
class CostModel:
    """Per-backend constants of the replay's cost model.

    Geometry: ``num_layers``, ``kv_width_k`` / ``kv_width_v`` (H_kv * d per layer),
    ``storage_bytes`` (bytes per stored element). Speeds: ``prefill`` = ``[(length, tokens/s)]``,
    the rate of a full prefill of that length from scratch (interpolated in between, flat
    outside); ``forward_fixed_s``, what every forward costs whatever its length (a launch and
    per-layer floor, ~25 ms on the H100 of docs/gpu-results/h100/, which a rate alone scales
    away: :meth:`prefill_s` charges it once per forward; fitted by ``calibrate`` as the intercept
    of the prefill times, :func:`split_forward_fixed`, and derived so when a calibration saved
    before it is loaded); ``decode_tokens_per_s``, ``apply_bytes_per_s`` (relocate + rank-m
    patch, bytes of page written),
    ``form_fixed_s`` + ``svd_s_per_token`` x tokens (the cost of forming a patch beyond its
    conditioned forward: a fixed part per patch, its factorization's F x F eigenproblems whatever
    the chunk's length, and a per-token part; 0.0 fixed in calibrations saved before it was split),
    ``host_bytes_per_s`` / ``disk_bytes_per_s`` (tier transfers). ``rank``: the patch rank m.
    ``source``: ``"calibration"`` or ``"defaults"``; ``fingerprint`` / ``model``: whose numbers.
    """

    num_layers: int = 30
    kv_width_k: int = 192
    kv_width_v: int = 192
    storage_bytes: int = 2
    prefill: tuple[tuple[int, float], ...] = ((128, 1500.0), (512, 1800.0), (2048, 1200.0), (8192, 500.0))
    decode_tokens_per_s: float = 40.0
    apply_bytes_per_s: float = 2.0e9
    svd_s_per_token: float = 2.0e-5
    form_fixed_s: float = 0.0
    forward_fixed_s: float = 0.0
    host_bytes_per_s: float = 8.0e9
    disk_bytes_per_s: float = 1.0e9
    rank: int = DEFAULT_RANK
    source: str = "defaults"
    fingerprint: str = ""
    model: str = "SmolLM2-135M-Instruct (geometry only)"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def geometry_of(cls, backend: Any, *, storage_bytes: int, rank: int = DEFAULT_RANK, **speeds: Any) -> "CostModel":
        """A cost model with ``backend``'s KV geometry (layers, K and V widths), ``storage_bytes`` per
        stored element and ``rank``; speeds from ``speeds`` or the defaults."""
        lay = backend.layout
        return cls(num_layers=lay.num_layers, kv_width_k=lay.k_heads * lay.k_dim, kv_width_v=lay.v_heads * lay.v_dim,
                   storage_bytes=int(storage_bytes), rank=int(rank), **speeds)

    # ------------------------------------------------------------------ sizes
    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token's canonical KV takes (all layers, K and V)."""
        return self.num_layers * (self.kv_width_k + self.kv_width_v) * self.storage_bytes

    def patch_bytes(self, tokens: int, rank: int | None = None) -> int:
        """Bytes of a rank-m patch of a ``tokens``-token chunk: m (T + F) per layer, K and V."""
        m = self.rank if rank is None else rank
        mk, mv = min(m, tokens, self.kv_width_k), min(m, tokens, self.kv_width_v)
        return self.num_layers * (mk * (tokens + self.kv_width_k) + mv * (tokens + self.kv_width_v)) * self.storage_bytes

    # ------------------------------------------------------------------ times
    def tokens_per_s(self, length: int) -> float:
        xs = _lengths(self.prefill)
        i = bisect.bisect_left(xs, length)
        if i <= 0:
            return self.prefill[0][1]
        if i >= len(xs):
            return self.prefill[-1][1]
        (x0, y0), (x1, y1) = self.prefill[i - 1], self.prefill[i]
        return y0 + (y1 - y0) * (length - x0) / (x1 - x0)

    def per_token_s(self, length: int) -> float:
        """Seconds one more token adds to a forward ending at ``length`` tokens: the table's seconds
        per token there less the fixed part spread over a full prefill of that length
        (``1 / tokens_per_s(L) - forward_fixed_s / L``, at least 0), so that a full prefill of ``L``
        tokens from scratch costs what the table says."""
        if length <= 0:
            return 0.0
        return max(0.0, 1.0 / self.tokens_per_s(length) - self.forward_fixed_s / length)

    def prefill_s(self, tokens: int, context: int = 0) -> float:
        """Seconds of one forward of ``tokens`` tokens after ``context`` cached tokens: the fixed
        part once, plus :meth:`per_token_s` at the length it ends at per token
        (``forward_fixed_s + tokens x per_token_s(context + tokens)``; with no fixed part, the
        table's ``tokens / tokens_per_s(context + tokens)``)."""
        return self.forward_fixed_s + tokens * self.per_token_s(context + tokens) if tokens > 0 else 0.0

    def marginal_tokens_per_s(self, length: int) -> float:
        """Tokens per second one more token of a forward ending at ``length`` runs at
        (``1 / per_token_s(length)``; the table's rate when there is no fixed part): the rate that,
        with :attr:`forward_fixed_s` per forward, prices a forward exactly there (an idle budget
        counted in tokens: ``replay --idle-rate calibrated``).

        Raises:
            ArgumentError: the fixed part leaves no time per token at ``length`` (a table whose
                time there is the fixed part itself).
        """
        from ..core.errors import ArgumentError

        per_token = self.per_token_s(length)
        if per_token <= 0:
            raise ArgumentError(f"the cost model's fixed part per forward ({self.forward_fixed_s * 1e3:.3g} ms) leaves no "
                                f"time per token at {length} tokens: no marginal rate there")
        return 1.0 / per_token

    def factorize_s(self, tokens: int) -> float:
        """Seconds to factorize one patch of ``tokens`` tokens beyond its forward (a ``Difference``,
        or a ``Form``'s factorization): ``form_fixed_s + tokens x svd_s_per_token``."""
        return self.form_fixed_s + tokens * self.svd_s_per_token if tokens > 0 else 0.0

    def form_s(self, tokens: int, context: int) -> float:
        """Seconds to form one patch: its conditioned forward plus the factorization."""
        return self.prefill_s(tokens, context) + self.factorize_s(tokens)

    def form_floor_s(self, tokens: int) -> float:
        """The fewest seconds forming a patch of ``tokens`` tokens can take behind any context
        (at the fastest prefill speed): a lower bound of :meth:`form_s` (the scheduler's search
        bounds by it): a forward costs at least its fixed part, and at least ``tokens`` at the
        table's fastest rate (``prefill_s`` >= ``forward_fixed_s + tokens / fastest - forward_fixed_s``
        as ``tokens <= context + tokens``)."""
        if tokens <= 0:
            return 0.0
        return max(self.forward_fixed_s, tokens / _fastest(self.prefill)) + self.factorize_s(tokens)

    def seconds(self, op: Op) -> float:
        """Modelled seconds of one planned operation (``window.plan``): the one price list the
        replay charges a plan by."""
        if isinstance(op, Encode):
            return self.prefill_s(op.tokens, 0)
        if isinstance(op, Forward):
            return self.prefill_s(op.tokens, op.context)
        if isinstance(op, Form):
            # its forwards, then one factorization (a kind that runs two forwards factorizes once)
            return op.forwards * self.prefill_s(op.tokens, op.context) + self.factorize_s(op.tokens)
        if isinstance(op, Difference):
            return self.factorize_s(op.tokens)
        if isinstance(op, Load):
            return op.nbytes / (self.host_bytes_per_s if op.tier == "host" else self.disk_bytes_per_s)
        return 0.0  # a store hit, a keep or a clear: no model work

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["prefill"] = [list(p) for p in self.prefill]
        d["version"] = CALIBRATION_VERSION
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "CostModel":
        """The cost model :meth:`to_json` wrote.

        Raises:
            ArgumentError: ``d`` is not a calibration (a field this class does not have, or no
                prefill table of ``[length, tokens/s]`` pairs).
        """
        from ..core.errors import ArgumentError

        d = dict(d)
        d.pop("version", None)
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ArgumentError(f"not a calibration: unknown fields {unknown} (a calibration's own notes go in 'extra')")
        try:
            d["prefill"] = tuple((int(a), float(b)) for a, b in d["prefill"])
        except (KeyError, TypeError, ValueError) as e:
            raise ArgumentError(f"not a calibration: no prefill table of [length, tokens/s] pairs ({e!r})") from None
        if "forward_fixed_s" not in d:  # saved before forwards had a fixed part: its own table's intercept
            extra = dict(d.get("extra") or {})
            d["forward_fixed_s"], d["prefill"] = split_forward_fixed(d["prefill"], extra.get("lengths"))
            extra["forward_fixed_s_derived"] = True
            d["extra"] = extra
        return cls(**d)

    @property
    def derivation_note(self) -> str:
        """A sentence saying that :attr:`forward_fixed_s` was derived at load (a calibration saved
        before it), or ""."""
        if not self.extra.get("forward_fixed_s_derived"):
            return ""
        return (f"forward_fixed_s not in the file (saved before it): derived from its prefill table, "
                f"{self.forward_fixed_s * 1e3:.2f} ms per forward")


def fit_fixed_and_slope(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(fixed, slope)``, both >= 0, of the line ``fixed + slope x n`` closest (least squares) to
    ``points`` = ``[(n, seconds)]`` (at least two distinct n): a cost's fixed part and its part per
    unit (per token, per forward token). Two points give the line through them; where that line's
    slope or intercept is negative (a noisy measurement: a cost never falls with size, nor is
    below nothing), that part is 0 and the other is the least-squares fit alone (the mean of the
    seconds; or the slope through the origin, ``sum(n s) / sum(n^2)``).

    Raises:
        ArgumentError: fewer than two distinct n, or an n that is not positive.
    """
    from ..core.errors import ArgumentError

    ns = [float(n) for n, _ in points]
    ys = [float(y) for _, y in points]
    if len(set(ns)) < 2 or min(ns) <= 0:
        raise ArgumentError(f"fitting a fixed and a per-token part needs two distinct positive lengths, got {sorted(set(ns))}")
    mn, my = statistics.fmean(ns), statistics.fmean(ys)
    slope = sum((n - mn) * (y - my) for n, y in zip(ns, ys)) / sum((n - mn) ** 2 for n in ns)
    fixed = my - slope * mn
    if slope < 0:
        return max(0.0, my), 0.0
    if fixed < 0:
        return 0.0, max(0.0, sum(n * y for n, y in zip(ns, ys)) / sum(n * n for n in ns))
    return fixed, slope


def split_forward_fixed(prefill: Sequence[tuple[int, float]],
                        lengths: Sequence[int] | None = None) -> tuple[float, tuple[tuple[int, float], ...]]:
    """``(forward_fixed_s, table)`` from a prefill table ``[(length, tokens/s)]``.

    ``forward_fixed_s``: a forward's fixed part, in seconds, the intercept ``a`` of
    ``time = a + n / r`` fitted (least squares, :func:`fit_fixed_and_slope`) to each measured
    prefill's time, at most the shortest measured time (no forward costs more than one measured
    whole); 0.0 for fewer than two distinct lengths. ``lengths``: the tokens each measurement
    prefilled (``calibrate``'s ``--lengths``, behind the model's root; its time is
    ``n / tokens/s``); None (or not one per row): the table's lengths (a prefill from scratch).

    ``table``: the table restated as what :class:`CostModel` reads it as, the rate of a full
    prefill of each row's length ``L`` from scratch: ``L / (a + L x (s - a) / n)`` for ``n``
    tokens measured in ``s`` seconds behind ``L - n`` (the root's tokens at that measurement's
    time per token), so that ``prefill_s(n, L - n)`` is the measured ``s``. With no fixed part
    (or ``n == L``) the table as measured."""
    ns = [int(n) for n in lengths] if lengths is not None and len(lengths) == len(prefill) else [int(L) for L, _ in prefill]
    rows = [(int(L), n, n / float(rate)) for n, (L, rate) in zip(ns, prefill) if n > 0 and rate > 0]
    table = tuple((int(L), float(rate)) for L, rate in prefill)
    if len({n for _, n, _ in rows}) < 2:
        return 0.0, table
    fixed, _ = fit_fixed_and_slope([(n, s) for _, n, s in rows])
    fixed = min(fixed, min(s for _, _, s in rows))
    if fixed <= 0 or len(rows) != len(table):
        return max(0.0, fixed), table
    return fixed, tuple((L, L / (fixed + L * (s - fixed) / n)) for L, n, s in rows)


@functools.lru_cache(maxsize=64)
def _lengths(prefill: tuple[tuple[int, float], ...]) -> list[int]:
    """The context lengths of a prefill table (cached: the replay asks per forward)."""
    return [p[0] for p in prefill]


@functools.lru_cache(maxsize=64)
def _fastest(prefill: tuple[tuple[int, float], ...]) -> float:
    return max(p[1] for p in prefill)


DEFAULTS = CostModel()


def calibration_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    from ..model.default_model import default_cache_dir

    return (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / "calibration"


def save_calibration(model: CostModel, cache_dir: str | os.PathLike | None = None) -> Path:
    """Write ``<cache>/calibration/<fingerprint>.json`` atomically; returns the path."""
    d = calibration_dir(cache_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{model.fingerprint or 'unknown'}.json"
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".cal.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(model.to_json(), f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def load_calibration(fingerprint: str | None = None, cache_dir: str | os.PathLike | None = None,
                     path: str | os.PathLike | None = None) -> tuple[CostModel, str]:
    """The saved calibration (by explicit ``path``, by ``fingerprint``, or else the newest one
    saved), and a sentence saying which was used — or :data:`DEFAULTS` and why."""
    if path is not None:
        return _loaded(Path(path))
    d = calibration_dir(cache_dir)
    if fingerprint is not None:
        p = d / f"{fingerprint}.json"
        if p.exists():
            return _loaded(p)
        return DEFAULTS, f"no calibration saved for model {fingerprint[:12]}: using built-in defaults (run `contextdeque calibrate`)"
    found = sorted(d.glob("*.json"), key=lambda p: (p.stat().st_mtime, p.name)) if d.exists() else []
    if not found:
        return DEFAULTS, "no calibration found: using built-in defaults (run `contextdeque calibrate`)"
    return _loaded(found[-1])


def _loaded(path: Path) -> tuple[CostModel, str]:
    """The calibration at ``path`` and the sentence naming it (with what was derived at load)."""
    model = CostModel.from_json(json.loads(path.read_text()))
    note = model.derivation_note
    return model, f"calibration {path}" + (f" ({note})" if note else "")
