"""Mixed-precision patch factors: every kept direction of a patch stored at its own precision.

A patch keeps, per layer and K/V, directions ``j`` of Δ: the pair ``u_j = U_j s_j`` (``T``
values) and ``w_j = V_j^T`` (``F`` values). Transform coding under a bit budget (reverse
water-filling) gives each component bits by its variance: a leading direction carries much of
Δ's energy and deserves full precision, a tail direction little, and a coarse copy of it is
worth more than none. So each direction is stored at one of :data:`PRECISIONS`:

- ``"hi"``: the patch's storage dtype (the chunk's: fp32 by default, bf16 / fp16 when chosen;
  fp32 where fp16 would overflow), ``(T + F) · element_size`` bytes;
- ``"bf16"``: bfloat16 (the same bytes as ``hi`` when that is bf16; half of fp32's):
  ``(T + F) · 2`` bytes;
- ``"int8"``: symmetric, one scale per vector (``absmax / 127``, fp32): ``T + F + 8`` bytes;
- ``"int4"``: ``absmax / 7`` per group of :data:`INT4_GROUP` values (one scale per vector
  leaves most of a heavy-tailed ``u`` in the zero bin), two values a byte, each vector padded to
  whole bytes: ``⌈T/2⌉ + ⌈F/2⌉ + 4 (⌈T/32⌉ + ⌈F/32⌉)`` bytes;

plus one byte per kept direction naming its precision (:func:`direction_cost` is exactly what
:attr:`MixedFactors.nbytes` counts). What a precision costs in captured energy is measured, not
modelled: :func:`direction_errors` is each direction's exact error energy
``‖u_j w_jᵀ − u'_j w'_jᵀ‖²`` at that precision; the errors of different directions are
orthogonal to first order (the factors are), so a patch's residual is the dropped directions'
energy plus its kept directions' errors.

The factors are dequantized (to fp32) when a layer's factors are read (:meth:`MixedFactors.layer`),
i.e. before the apply kernels, which take float factors only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..core.chunk import check_finite, digest
from ..core.errors import CorruptEntryError, PatchError
from ..core.kv import tensor_nbytes

PRECISIONS = ("hi", "bf16", "int8", "int4")
"""Storage precisions of one direction, most bytes first (``hi``: the patch's storage dtype)."""

DEFAULT_PATCH_PRECISIONS = PRECISIONS
"""What a window's fidelity target allocates by default (``ContextWindow(patch_precisions=)``):
every precision. Measured on the default model and on Qwen2.5-Coder-0.5B (docs/fidelity.md): the
same median η as uniform ranks with 4.8-7.5x fewer bytes than at fp32 (the page dtype) and
7-50% fewer than uniform ranks stored at int8, and target 0.99 met under the default cap where
the rank-only rule misses; ``("hi",)`` is the rank-only rule."""

PRECISION_CODE = {"hi": 0, "bf16": 16, "int8": 8, "int4": 4}
_FLOAT_TIERS = {"bf16": torch.bfloat16}  # float precisions other than the patch's own
"""The byte each kept direction stores to name its precision."""

_LEVELS = {"int8": 127, "int4": 7}  # symmetric integer range ±levels
SCALE_DTYPE = torch.float32
INT4_GROUP = 32
"""Values sharing one int4 scale."""
SCALE_BYTES = 4
CODE_BYTES = 1
TENSOR_PREFIX = "q_"
"""Names of a mixed patch's tensors in a store entry: ``q_{k|v}_code``, ``q_{k|v}_{u|w}_{tier}``
and ``q_{k|v}_{u|w}_{tier}_scale`` for tier in int8 / int4."""


def check_precisions(precisions: Sequence[str]) -> tuple[str, ...]:
    """``precisions`` as a tuple, each one of :data:`PRECISIONS`, at least one.

    Raises:
        PatchError: an unknown or empty set of precisions."""
    out = tuple(dict.fromkeys(str(p) for p in precisions))
    if not out or any(p not in PRECISIONS for p in out):
        raise PatchError(f"precisions must be a non-empty subset of {PRECISIONS}, got {list(precisions)}")
    return out


def packed_width(precision: str, n: int) -> int:
    """Stored elements (bytes for the integer tiers) of one ``n``-value vector."""
    return (int(n) + 1) // 2 if precision == "int4" else int(n)


def scale_count(precision: str, n: int) -> int:
    """Scales one ``n``-value vector stores at an integer ``precision``."""
    return -(-int(n) // INT4_GROUP) if precision == "int4" else 1


def direction_cost(precision: str, n_tokens: int, width: int, element_size: int) -> int:
    """Bytes one direction of a ``[n_tokens, width]`` Δ costs at ``precision`` (its precision
    byte included); ``element_size``: the ``hi`` dtype's."""
    T, F = int(n_tokens), int(width)
    if precision == "hi":
        return (T + F) * int(element_size) + CODE_BYTES
    if precision in _FLOAT_TIERS:
        return (T + F) * _FLOAT_TIERS[precision].itemsize + CODE_BYTES
    if precision in _LEVELS:
        return (packed_width(precision, T) + packed_width(precision, F)
                + (scale_count(precision, T) + scale_count(precision, F)) * SCALE_BYTES + CODE_BYTES)
    raise PatchError(f"unknown precision {precision!r}; known: {PRECISIONS}")


def _group_view(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``x [n, D]`` as ``[n, groups, size]``: one group is the whole row, more are groups of
    :data:`INT4_GROUP` values (the last zero-padded)."""
    n, D = x.shape
    size = max(D, 1) if groups == 1 else INT4_GROUP
    pad = groups * size - D
    if pad:
        x = torch.cat([x, x.new_zeros(n, pad)], dim=1)
    return x.view(n, groups, size)


def quantize_rows(x: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x [n, D]`` at an integer ``precision``: ``(codes, scales)``; int8: codes ``int8
    [n, D]``, scales fp32 ``[n]`` (one per row); int4: codes ``uint8 [n, ⌈D/2⌉]`` (value + 8 in
    each nibble, the low nibble first), scales fp32 ``[n, ⌈D/32⌉]`` (one per group of
    :data:`INT4_GROUP`). A zero group gets scale 0."""
    if precision not in _LEVELS:
        raise PatchError(f"quantize_rows takes an integer precision {tuple(_LEVELS)}, got {precision!r}")
    x = x.to(torch.float32)
    n, D = x.shape
    levels = _LEVELS[precision]
    groups = scale_count(precision, D)
    g = _group_view(x, groups)
    scale = g.abs().amax(dim=2) / levels if D else x.new_zeros(n, groups)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(g / safe[:, :, None]).clamp(-levels, levels).reshape(n, g.shape[1] * g.shape[2])[:, :D]
    if precision == "int8":
        return q.to(torch.int8), scale[:, 0].to(SCALE_DTYPE)
    nib = (q + 8).to(torch.uint8)
    if nib.shape[1] % 2:
        nib = torch.cat([nib, torch.full((nib.shape[0], 1), 8, dtype=torch.uint8)], dim=1)
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)), scale.to(SCALE_DTYPE)


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, precision: str, width: int) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: fp32 ``[n, width]``."""
    if precision == "int8":
        return codes.to(torch.float32) * scales.to(torch.float32)[:, None]
    lo, hi = (codes & 0x0F).to(torch.float32), (codes >> 4).to(torch.float32)
    n = codes.shape[0]
    q = torch.stack([lo, hi], dim=2).reshape(n, 2 * codes.shape[1])[:, : int(width)] - 8.0
    g = _group_view(q, scales.shape[1]) * scales.to(torch.float32)[:, :, None]
    return g.reshape(n, g.shape[1] * g.shape[2])[:, : int(width)]


def round_trip(x: torch.Tensor, precision: str, hi_dtype: torch.dtype) -> torch.Tensor:
    """Rows of ``x [n, D]`` stored at ``precision`` and read back (fp32)."""
    if precision == "hi" or precision in _FLOAT_TIERS:
        return x.to(_FLOAT_TIERS.get(precision, hi_dtype)).to(torch.float32)
    return dequantize_rows(*quantize_rows(x, precision), precision, x.shape[1])


def direction_errors(u: torch.Tensor, w: torch.Tensor, precision: str, hi_dtype: torch.dtype) -> torch.Tensor:
    """Exact error energy of each direction stored at ``precision``: float64 ``[m]`` of
    ``‖u_j w_jᵀ − u'_j w'_jᵀ‖²`` for ``u [T, m]``, ``w [m, F]`` (``'``: read back)."""
    u64, w64 = u.to(torch.float64).T, w.to(torch.float64)  # [m, T], [m, F]
    uq = round_trip(u.T, precision, hi_dtype).to(torch.float64)
    wq = round_trip(w, precision, hi_dtype).to(torch.float64)
    # u wᵀ − u' w'ᵀ = u δwᵀ + δu w'ᵀ (δw = w − w', δu = u − u'): no cancellation of large terms
    du, dw = u64 - uq, w64 - wq
    err = (u64.pow(2).sum(1) * dw.pow(2).sum(1) + du.pow(2).sum(1) * wq.pow(2).sum(1)
           + 2.0 * (u64 * du).sum(1) * (dw * wq).sum(1))
    return err.clamp_min(0.0)


@dataclass(frozen=True)
class MixedFactors:
    """One patch's K and V factors, each kept direction at its own precision.

    Per ``t`` in ``"k"`` / ``"v"``: ``ranks[t]`` directions per layer (of the patch's ``layers``),
    listed layer by layer, each layer's top-down; ``tensors[f"q_{t}_code"]``: uint8 ``[Σ ranks]``
    precision codes (:data:`PRECISION_CODE`) in that order; per tier, the rows of the directions
    stored there, in that order: ``q_{t}_u_{tier} [n_tier, T]``, ``q_{t}_w_{tier} [n_tier, F]``
    (``hi``: the patch's float dtype; bf16; int8: int8; int4: packed uint8 ``[n_tier, ⌈T/2⌉]``),
    and for the integer tiers their scales ``..._scale``, fp32 ``[n_tier]`` (int8) or
    ``[n_tier, ⌈T/32⌉]`` (int4; likewise F). Built by :func:`mix_factors`; checked where built
    (:meth:`check`: a stored entry that disagrees is a ``CorruptEntryError``)."""

    n_tokens: int
    widths: dict[str, int]
    ranks: dict[str, tuple[int, ...]]
    tensors: dict[str, torch.Tensor]
    _rows: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.check()
        check_finite([t for n, t in self.tensors.items() if t.is_floating_point()], "a mixed-precision patch's factors")
        for t in ("k", "v"):  # each direction's row within its tier
            code = self.tensors[f"{TENSOR_PREFIX}{t}_code"].to(torch.int64)
            row = torch.zeros_like(code)
            for c in PRECISION_CODE.values():
                sel = code == c
                row[sel] = torch.arange(int(sel.sum()))
            self._rows[t] = row

    @property
    def nbytes(self) -> int:
        """Bytes stored: every tensor's payload (the precision codes and scales included)."""
        return sum(tensor_nbytes(x) for x in self.tensors.values())

    @property
    def hi_dtype(self) -> torch.dtype:
        return self.tensors[f"{TENSOR_PREFIX}k_u_hi"].dtype

    def precisions(self, t: str, i: int) -> list[str]:
        """Precision of each direction of layer index ``i`` of ``t`` (``"k"`` / ``"v"``)."""
        names = {c: p for p, c in PRECISION_CODE.items()}
        start = sum(self.ranks[t][:i])
        code = self.tensors[f"{TENSOR_PREFIX}{t}_code"][start:start + self.ranks[t][i]]
        return [names[int(c)] for c in code]

    def counts(self) -> dict[str, int]:
        """Directions stored at each precision, K and V together."""
        out = {}
        for p, c in PRECISION_CODE.items():
            out[p] = sum(int((self.tensors[f"{TENSOR_PREFIX}{t}_code"] == c).sum()) for t in ("k", "v"))
        return out

    def key(self) -> str:
        """A digest of the precisions (two patches of one allocation at other precisions differ)."""
        return digest(self.tensors[f"{TENSOR_PREFIX}k_code"], self.tensors[f"{TENSOR_PREFIX}v_code"])[:16]

    def layer(self, t: str, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized fp32 ``(u [T, m_i], w [m_i, F])`` of layer index ``i`` of ``t``."""
        T, F, m = self.n_tokens, self.widths[t], self.ranks[t][i]
        start = sum(self.ranks[t][:i])
        code = self.tensors[f"{TENSOR_PREFIX}{t}_code"][start:start + m].to(torch.int64)
        rows = self._rows[t][start:start + m]
        u, w = torch.zeros(T, m), torch.zeros(m, F)
        for p, c in PRECISION_CODE.items():
            sel = (code == c).nonzero().flatten()
            if not sel.numel():
                continue
            idx = rows[sel]
            for part, out, n in (("u", u, T), ("w", w, F)):
                stored = self.tensors[f"{TENSOR_PREFIX}{t}_{part}_{p}"][idx]
                vals = (stored.to(torch.float32) if p not in _LEVELS else
                        dequantize_rows(stored, self.tensors[f"{TENSOR_PREFIX}{t}_{part}_{p}_scale"][idx], p, n))
                if part == "u":
                    out[:, sel] = vals.T
                else:
                    out[sel] = vals
        return u, w

    def cut(self, keep: Sequence[int], ranks_k: Sequence[int], ranks_v: Sequence[int]) -> "MixedFactors":
        """The factors of layer indices ``keep`` only, each cut to its top ``ranks_k[j]`` /
        ``ranks_v[j]`` directions (at the precisions they were stored at)."""
        tensors: dict[str, torch.Tensor] = {}
        ranks = {"k": tuple(int(r) for r in ranks_k), "v": tuple(int(r) for r in ranks_v)}
        for t in ("k", "v"):
            starts = [sum(self.ranks[t][:i]) for i in range(len(self.ranks[t]))]
            chosen = torch.tensor([starts[i] + j for i, m in zip(keep, ranks[t]) for j in range(m)], dtype=torch.int64)
            code = self.tensors[f"{TENSOR_PREFIX}{t}_code"]
            new_code = code[chosen]
            tensors[f"{TENSOR_PREFIX}{t}_code"] = new_code.clone()
            for p, c in PRECISION_CODE.items():
                idx = self._rows[t][chosen[new_code.to(torch.int64) == c]]
                for part in ("u", "w"):
                    name = f"{TENSOR_PREFIX}{t}_{part}_{p}"
                    tensors[name] = self.tensors[name][idx].clone()
                    if p in _LEVELS:
                        tensors[f"{name}_scale"] = self.tensors[f"{name}_scale"][idx].clone()
        return MixedFactors(self.n_tokens, dict(self.widths), ranks, tensors)

    def check(self) -> None:
        """Refuse factors whose tensors disagree with the recorded ranks and widths.

        Raises:
            CorruptEntryError: a tensor is missing, of another dtype or shape, or a code is unknown."""
        T = self.n_tokens
        for t in ("k", "v"):
            code = self.tensors.get(f"{TENSOR_PREFIX}{t}_code")
            if code is None or code.dtype != torch.uint8 or tuple(code.shape) != (sum(self.ranks[t]),):
                raise CorruptEntryError(f"mixed patch entry: {t} precision codes missing or not uint8 [{sum(self.ranks[t])}]")
            if any(int(c) not in PRECISION_CODE.values() for c in code.unique()):
                raise CorruptEntryError(f"mixed patch entry: unknown {t} precision codes {code.unique().tolist()}")
            for p, c in PRECISION_CODE.items():
                n = int((code == c).sum())
                for part, width in (("u", T), ("w", self.widths[t])):
                    name = f"{TENSOR_PREFIX}{t}_{part}_{p}"
                    x = self.tensors.get(name)
                    want = {"hi": None, "bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8}[p]
                    if (x is None or x.dim() != 2 or tuple(x.shape) != (n, packed_width(p, width))
                            or (want is None and not x.is_floating_point()) or (want is not None and x.dtype != want)):
                        got = None if x is None else (x.dtype, tuple(x.shape))
                        raise CorruptEntryError(f"mixed patch entry: {name} should hold {n} rows of {width} values, got {got}")
                    if p in _LEVELS:
                        s = self.tensors.get(f"{name}_scale")
                        want_s = (n,) if p == "int8" else (n, scale_count(p, width))
                        if s is None or s.dtype != SCALE_DTYPE or tuple(s.shape) != want_s:
                            raise CorruptEntryError(f"mixed patch entry: {name}_scale should be fp32 {list(want_s)}")


def mix_factors(blocks: dict[str, list[tuple[torch.Tensor, torch.Tensor]]],
                precisions: dict[str, list[Sequence[str]]], hi_dtype: torch.dtype, n_tokens: int,
                widths: dict[str, int]) -> MixedFactors:
    """Store ``blocks[t][i] = (u [T, m_i], w [m_i, F_t])`` with direction ``j`` of layer ``i`` of
    ``t`` at ``precisions[t][i][j]`` (one per direction; ``hi``: ``hi_dtype``); ``T = n_tokens``,
    ``F_t = widths[t]``.

    Raises:
        PatchError: the precisions do not match the blocks, or name an unknown precision."""
    T = int(n_tokens)
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, tuple[int, ...]] = {}
    for t in ("k", "v"):
        bl, pr, F = blocks[t], precisions[t], int(widths[t])
        if len(bl) != len(pr) or any(len(p) != u.shape[1] for (u, _), p in zip(bl, pr)):
            raise PatchError(f"one precision per kept {t} direction is needed")
        if any(tuple(u.shape) != (T, w.shape[0]) or w.shape[1] != F for u, w in bl):
            raise PatchError(f"{t} factors must be u [{T}, m] and w [m, {F}]")
        flat = [p for ps in pr for p in ps]
        if any(p not in PRECISION_CODE for p in flat):
            raise PatchError(f"precisions must be among {PRECISIONS}, got {sorted(set(flat))}")
        us = torch.cat([u.T.to(torch.float32) for u, _ in bl] + [torch.zeros(0, T)])
        ws = torch.cat([w.to(torch.float32) for _, w in bl] + [torch.zeros(0, F)])
        ranks[t] = tuple(int(u.shape[1]) for u, _ in bl)
        code = torch.tensor([PRECISION_CODE[p] for p in flat], dtype=torch.uint8)
        tensors[f"{TENSOR_PREFIX}{t}_code"] = code
        for p, c in PRECISION_CODE.items():
            sel = (code == c).nonzero().flatten()
            for part, x in (("u", us), ("w", ws)):
                name = f"{TENSOR_PREFIX}{t}_{part}_{p}"
                if p not in _LEVELS:
                    tensors[name] = x[sel].to(_FLOAT_TIERS.get(p, hi_dtype)).contiguous()
                else:
                    q, s = quantize_rows(x[sel], p)
                    tensors[name], tensors[f"{name}_scale"] = q.contiguous(), s.contiguous()
    return MixedFactors(T, {t: int(widths[t]) for t in ("k", "v")}, ranks, tensors)
