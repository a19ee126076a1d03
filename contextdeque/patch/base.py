"""The conditioning patch: top-m SVD factors of Δ = KV(B|A) − KV(B|∅), per layer, K and V separately.

A patch kind is one small class (one file each, self-registering): it says how the target Δ is
measured (one conditioned forward, a mean over orderings, relative to the current overlay...) and
how it is factorized (every layer, the deepest layers only, onto a shared basis). Everything else
— the conditioned forward, content-frame subtraction, the SVD, bookkeeping — lives here once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import torch

from ..core.chunk import FP16_MAX, Chunk, check_finite, digest, format_bytes
from ..core.cooperative import checkpoint
from ..core.args import check_float, check_instance, check_int, check_str
from ..core.errors import ArgumentTypeError, CorruptEntryError, FingerprintMismatchError, PatchError
from ..core.kv import LayerKV, concat_kv, tensor_nbytes
from ..core.operator import relocate, to_content_frame
from ..core.registry import Registered, Registry
from .factors import TENSOR_PREFIX, MixedFactors
from .keys import patch_signature
from .rank import DEFAULT_RANK, is_full, resolve_rank
from .topm import kv_in_one_call, truncated_svd

if TYPE_CHECKING:  # pragma: no cover
    from ..model.hf import HFBackend

PATCH_KINDS: Registry["PatchKind"] = Registry("patch kind")


@dataclass
class Patch:
    """Rank-m conditioning factors for one chunk on one antecedent context.

    Per layer l in ``layers`` (index ``i`` into the factor tensors):
      ``k_u[i]: [T, m_k]`` (= U_m S_m), ``k_w[i]: [m_k, H_k*d_k]`` (= V_m^T), likewise ``v_u``/``v_w``.
    Shared-basis patches keep only ``k_u``/``v_u`` and reference a basis (``basis_id``) whose
    ``w`` tensors are attached at load time. Layers not listed carry no correction.

    Per-layer ranks (an allocated patch, :mod:`contextdeque.patch.alloc`): ``ranks_k`` / ``ranks_v``
    give each listed layer's rank (0 allowed), ``rank_k`` / ``rank_v`` are their maxima, and the
    factors are flat 1-D buffers: layer i's ``[T, m_i]`` block of ``U S`` followed by layer i+1's,
    likewise ``[m_i, F]`` for ``V^T`` (each block contiguous, as the kernels take it). Empty
    ``ranks_k`` / ``ranks_v``: every layer has ``rank_k`` / ``rank_v`` (the stacked form above).

    Mixed precision (:mod:`contextdeque.patch.factors`): ``mixed`` holds every kept direction at
    its own precision (bf16/fp16, int8 or int4 with per-vector scales); the four factor tensors
    are then empty, per-layer ranks are always recorded, and :meth:`layer_factors` dequantizes.
    """

    chunk_id: str
    fingerprint: str
    layout_signature: str
    antecedent_signature: str
    antecedents: tuple[str, ...]
    kind: str
    rank_k: int
    rank_v: int
    n_tokens: int
    layers: tuple[int, ...]
    k_u: torch.Tensor
    k_w: torch.Tensor
    v_u: torch.Tensor
    v_w: torch.Tensor
    k_shape: tuple[int, int]  # (H_k, d_k)
    v_shape: tuple[int, int]
    basis_id: str | None = None
    meta: dict[str, str] = field(default_factory=dict)
    ranks_k: tuple[int, ...] = ()
    ranks_v: tuple[int, ...] = ()
    mixed: MixedFactors | None = None

    def __post_init__(self) -> None:
        # the one finite check of a patch's factors: where they enter (formed, loaded from a store
        # or a session), not at every apply
        check_finite([self.k_u, self.k_w, self.v_u, self.v_w], f"the {self.kind} patch factors of chunk {self.chunk_id[:12]}")

    def __repr__(self) -> str:
        basis = "" if self.basis_id is None else f", basis {self.basis_id[:8]}"
        return (
            f"Patch({self.kind}, chunk {self.chunk_id[:10]}, rank {self.rank_label}, "
            f"{self.n_tokens} tok, {len(self.layers)} layers, on {len(self.antecedents)} antecedents, "
            f"{format_bytes(self.nbytes)}{basis})"
        )

    @property
    def id(self) -> str:
        per_layer = (self.ranks_k, self.ranks_v) if self.per_layer else ()
        mixed = ("mixed", self.mixed.key()) if self.mixed is not None else ()
        return digest(self.chunk_id, self.antecedent_signature, self.kind, self.rank_k, self.rank_v, self.layers,
                      *per_layer, *mixed)[:32]

    @property
    def per_layer(self) -> bool:
        """Whether the layers have ranks of their own (the flat factor form)."""
        return bool(self.ranks_k or self.ranks_v)

    @property
    def layer_ranks(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(K ranks, V ranks)``, one per layer in ``layers``."""
        n = len(self.layers)
        return (self.ranks_k or (self.rank_k,) * n), (self.ranks_v or (self.rank_v,) * n)

    @property
    def rank_label(self) -> str:
        """``"32/32"`` for a uniform patch; ``"K<=24 V<=40 on 21 layers"`` for per-layer ranks
        (the maxima, and how many layers carry a correction)."""
        if not self.per_layer:
            return f"{self.rank_k}/{self.rank_v}"
        label = f"K<={self.rank_k} V<={self.rank_v} on {len(self.layers)} layers"
        if self.mixed is not None:
            label += " (" + " ".join(f"{p} {n}" for p, n in self.mixed.counts().items() if n) + ")"
        return label

    @property
    def nbytes(self) -> int:
        """Bytes this patch stores (a shared basis is amortized elsewhere and not counted; a
        mixed-precision patch: its codes, scales and rows, exactly)."""
        if self.mixed is not None:
            return self.mixed.nbytes
        parts = (self.k_u, self.v_u) if self.basis_id is not None else (self.k_u, self.v_u, self.k_w, self.v_w)
        return sum(tensor_nbytes(t) for t in parts)

    def bytes_fraction(self, chunk: Chunk) -> float:
        """Patch bytes over the chunk's page bytes."""
        return self.nbytes / max(1, chunk.nbytes)

    def check_fits(self, chunk: Chunk) -> None:
        if chunk.id != self.chunk_id:
            raise PatchError(f"patch was formed for chunk {self.chunk_id[:12]}, not {chunk.id[:12]}")
        if chunk.fingerprint != self.fingerprint or chunk.layout_signature != self.layout_signature:
            raise FingerprintMismatchError("patch was formed by a different model than the chunk's")

    def layer_delta(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """fp32 ``(dK [H_k,T,d_k], dV [H_v,T,d_v])`` for ``layer`` (None where it carries nothing)."""
        if layer not in self.layers:
            return None, None
        i = self.layers.index(layer)
        return (_expand(*self.layer_factors("k", i), self.k_shape), _expand(*self.layer_factors("v", i), self.v_shape))

    def layer_factors(self, which: str, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(u [T, m_i], w [m_i, F])`` of ``which`` ("k" / "v") at index ``i`` into ``layers``
        (contiguous views in either factor form; a mixed-precision patch's dequantized to fp32)."""
        if self.mixed is not None:
            return self.mixed.layer(which, i)
        u, w = (self.k_u, self.k_w) if which == "k" else (self.v_u, self.v_w)
        if not self.per_layer:
            return u[i], w[i]
        ranks = self.layer_ranks[0 if which == "k" else 1]
        T = self.n_tokens
        before = sum(ranks[:i])
        m = ranks[i]
        F = self._width(which)
        return (u[before * T:(before + m) * T].view(T, m), w[before * F:(before + m) * F].view(m, F))

    def _width(self, which: str) -> int:
        h, d = self.k_shape if which == "k" else self.v_shape
        return int(h) * int(d)

    def factors(self, layer: int) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """``((u_k [T,m], w_k [m,F]), (u_v, w_v))`` for the fused kernel, or Nones."""
        if layer not in self.layers:
            return None, None
        i = self.layers.index(layer)
        rk, rv = self.layer_ranks
        fk = self.layer_factors("k", i) if rk[i] else None
        fv = self.layer_factors("v", i) if rv[i] else None
        return fk, fv

    def to_entry(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors = {"k_u": self.k_u, "v_u": self.v_u}
        if self.mixed is not None:
            tensors = dict(self.mixed.tensors)
        elif self.basis_id is None:
            tensors.update(k_w=self.k_w, v_w=self.v_w)
        meta = {
            "kind": "patch",
            "patch_kind": self.kind,
            "chunk_id": self.chunk_id,
            "fingerprint": self.fingerprint,
            "layout": self.layout_signature,
            "antecedent_signature": self.antecedent_signature,
            "antecedents": json.dumps(list(self.antecedents)),
            "rank_k": str(self.rank_k),
            "rank_v": str(self.rank_v),
            "n_tokens": str(self.n_tokens),
            "layers": json.dumps(list(self.layers)),
            "k_shape": json.dumps(list(self.k_shape)),
            "v_shape": json.dumps(list(self.v_shape)),
            "basis_id": self.basis_id or "",
            "content_digest": self.id,
            "extra": json.dumps(self.meta, sort_keys=True),
        }
        if self.per_layer or self.mixed is not None:
            meta["ranks_k"], meta["ranks_v"] = (json.dumps(list(r)) for r in self.layer_ranks)
        if self.mixed is not None:
            meta["mixed"] = "1"
        return tensors, meta

    @classmethod
    def from_entry(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str], basis: "Any" = None) -> "Patch":
        try:
            basis_id = meta.get("basis_id") or None
            if basis_id is not None:
                if basis is None or basis.id != basis_id:
                    raise PatchError(f"patch needs shared basis {basis_id}")
                if "ranks_k" in meta:
                    raise CorruptEntryError("stored shared-basis patch entry records per-layer ranks")
                layers = json.loads(meta["layers"])
                k_w = torch.stack([basis.k_w[l][: int(meta["rank_k"])] for l in layers])
                v_w = torch.stack([basis.v_w[l][: int(meta["rank_v"])] for l in layers])
            mixed = None
            if meta.get("mixed"):
                if basis_id is not None:
                    raise CorruptEntryError("stored mixed-precision patch entry references a shared basis")
                (hk, dk), (hv, dv) = json.loads(meta["k_shape"]), json.loads(meta["v_shape"])
                mixed = MixedFactors(
                    int(meta["n_tokens"]), {"k": int(hk) * int(dk), "v": int(hv) * int(dv)},
                    {"k": tuple(int(r) for r in json.loads(meta["ranks_k"])),
                     "v": tuple(int(r) for r in json.loads(meta["ranks_v"]))},
                    {n: t for n, t in tensors.items() if n.startswith(TENSOR_PREFIX)})
                empty = torch.zeros(0, dtype=mixed.hi_dtype)
                tensors = {"k_u": empty, "v_u": empty}
                k_w = v_w = empty
            elif basis_id is None:
                k_w, v_w = tensors["k_w"], tensors["v_w"]
            patch = cls(
                chunk_id=meta["chunk_id"],
                fingerprint=meta["fingerprint"],
                layout_signature=meta["layout"],
                antecedent_signature=meta["antecedent_signature"],
                antecedents=tuple(json.loads(meta["antecedents"])),
                kind=meta["patch_kind"],
                rank_k=int(meta["rank_k"]),
                rank_v=int(meta["rank_v"]),
                n_tokens=int(meta["n_tokens"]),
                layers=tuple(json.loads(meta["layers"])),
                k_u=tensors["k_u"],
                k_w=k_w,
                v_u=tensors["v_u"],
                v_w=v_w,
                k_shape=tuple(json.loads(meta["k_shape"])),
                v_shape=tuple(json.loads(meta["v_shape"])),
                basis_id=basis_id,
                meta=json.loads(meta.get("extra", "{}")),
                ranks_k=tuple(int(r) for r in json.loads(meta.get("ranks_k", "[]"))),
                ranks_v=tuple(int(r) for r in json.loads(meta.get("ranks_v", "[]"))),
                mixed=mixed,
            )
            patch._check_consistent()
            return patch
        except PatchError:
            raise  # a missing/mismatched shared basis is the caller's to supply, not a corrupt entry
        except (KeyError, ValueError) as exc:
            raise CorruptEntryError(f"stored patch entry is malformed: {exc}") from exc

    def _check_consistent(self) -> None:
        """Refuse a decoded patch whose recorded ranks, layers and shapes disagree with its factors
        (``k_u [n, T, m_k]``, ``k_w [n, m_k, H_k*d_k]``, likewise V; n = len(layers)).

        Raises:
            CorruptEntryError: what is recorded is not what the factors hold."""
        for what, r in (("rank_k", self.rank_k), ("rank_v", self.rank_v), ("n_tokens", self.n_tokens)):
            if isinstance(r, bool) or r < 0:
                raise CorruptEntryError(f"stored patch entry records {what} = {r}")
        n = len(self.layers)
        if self.mixed is not None:
            self._check_mixed()
            return
        if self.per_layer:
            self._check_per_layer()
            return
        if n == 0:
            return
        for name, u, w, m, (h, d) in (("k", self.k_u, self.k_w, self.rank_k, self.k_shape),
                                       ("v", self.v_u, self.v_w, self.rank_v, self.v_shape)):
            if tuple(u.shape) != (n, self.n_tokens, m) or tuple(w.shape) != (n, m, h * d):
                raise CorruptEntryError(
                    f"stored patch entry records {n} layers, {self.n_tokens} tokens, {name} rank {m} and "
                    f"{name} shape {(h, d)}, but holds {name}_u {tuple(u.shape)} and {name}_w {tuple(w.shape)}"
                )

    def _check_mixed(self) -> None:
        """A mixed-precision patch's checks: its ranks, token count and widths are the recorded
        ones (its tensors are checked against them where :class:`MixedFactors` is built)."""
        n = len(self.layers)
        for name, ranks, top in (("k", self.ranks_k, self.rank_k), ("v", self.ranks_v, self.rank_v)):
            if (len(ranks) != n or tuple(ranks) != tuple(self.mixed.ranks[name]) or max(ranks, default=0) != top
                    or self.mixed.widths[name] != self._width(name)):
                raise CorruptEntryError(
                    f"stored mixed patch entry records {n} layers and {name} ranks {list(ranks)} (maximum {top}), "
                    f"but its factors hold ranks {list(self.mixed.ranks[name])} of width {self.mixed.widths[name]}")
        if self.mixed.n_tokens != self.n_tokens:
            raise CorruptEntryError(f"stored mixed patch entry records {self.n_tokens} tokens, its factors "
                                    f"{self.mixed.n_tokens}")

    def _check_per_layer(self) -> None:
        """The flat form's checks: one non-negative rank per layer, maxima as recorded, and flat
        factors of exactly ``T * sum(m)`` / ``sum(m) * F`` values."""
        n = len(self.layers)
        for name, ranks, top, u, w in (("k", self.ranks_k, self.rank_k, self.k_u, self.k_w),
                                       ("v", self.ranks_v, self.rank_v, self.v_u, self.v_w)):
            if len(ranks) != n or any(isinstance(r, bool) or r < 0 for r in ranks) or max(ranks, default=0) != top:
                raise CorruptEntryError(
                    f"stored patch entry records {n} layers and {name} ranks {list(ranks)} (maximum {top})")
            total, F = sum(ranks), self._width(name)
            if u.dim() != 1 or w.dim() != 1 or u.numel() != self.n_tokens * total or w.numel() != total * F:
                raise CorruptEntryError(
                    f"stored patch entry records {name} ranks summing to {total} over {self.n_tokens} tokens and width "
                    f"{F}, but holds {name}_u {tuple(u.shape)} and {name}_w {tuple(w.shape)}")


def _expand(u: torch.Tensor, w: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``u [T,m] @ w [m,H*d]`` -> ``[H, T, d]`` fp32."""
    T = u.shape[0]
    h, d = shape
    if u.shape[-1] == 0:
        return torch.zeros(h, T, d)
    return (u.to(torch.float32) @ w.to(torch.float32)).view(T, h, d).transpose(0, 1)


def new_patch(
    source: "Chunk | Patch",
    *,
    kind: str,
    antecedents: Sequence[str],
    signature: str,
    ranks: tuple[int, int],
    layers: Sequence[int],
    factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    layout: Any = None,
    dtype: torch.dtype | None = None,
    basis_id: str | None = None,
    meta: dict[str, str] | None = None,
    layer_ranks: tuple[Sequence[int], Sequence[int]] | None = None,
    mixed: MixedFactors | None = None,
) -> Patch:
    """The one construction of a :class:`Patch` from factors: the chunk's identity (id, model
    fingerprint, layout signature, token count) comes from ``source`` (the chunk, or a patch of
    it), the factor shapes from ``layout`` (else from ``source``, a patch); the factors
    ``(k_u, k_w, v_u, v_w)`` are cast to ``dtype`` (the chunk's storage dtype; float16 factors
    that would overflow stay float32: :func:`factor_dtype`). Non-finite factors raise
    ``NumericsError`` (:meth:`Patch.__post_init__`). ``layer_ranks``: ``(K ranks, V ranks)`` per
    layer of the flat factor form (``ranks`` are then their maxima). ``mixed``: the factors at
    mixed precision (``factors`` are then empty and ``layer_ranks`` required)."""
    if isinstance(source, Patch):
        chunk_id, n_tokens, k_shape, v_shape = source.chunk_id, source.n_tokens, source.k_shape, source.v_shape
    else:
        chunk_id, n_tokens = source.id, source.n_tokens
    if layout is not None:
        k_shape, v_shape = (layout.k_heads, layout.k_dim), (layout.v_heads, layout.v_dim)
    if dtype is not None:
        dtype = factor_dtype(dtype, factors)
    k_u, k_w, v_u, v_w = (t if dtype is None else t.to(dtype) for t in factors)
    return Patch(
        chunk_id=chunk_id,
        fingerprint=source.fingerprint,
        layout_signature=source.layout_signature,
        antecedent_signature=signature,
        antecedents=tuple(antecedents),
        kind=kind,
        rank_k=int(ranks[0]),
        rank_v=int(ranks[1]),
        n_tokens=n_tokens,
        layers=tuple(layers),
        k_u=k_u,
        k_w=k_w,
        v_u=v_u,
        v_w=v_w,
        k_shape=k_shape,
        v_shape=v_shape,
        basis_id=basis_id,
        meta=dict(meta or {}),
        ranks_k=() if layer_ranks is None else tuple(int(r) for r in layer_ranks[0]),
        ranks_v=() if layer_ranks is None else tuple(int(r) for r in layer_ranks[1]),
        mixed=mixed,
    )


# ---------------------------------------------------------------------------- forming


Antecedent = "Chunk | tuple[Chunk, Patch | Sequence[Patch] | None]"


@dataclass
class FormContext:
    """Everything a patch kind needs to measure its target Δ."""

    backend: "HFBackend"
    chunk: Chunk
    antecedents: list[tuple[Chunk, list[Patch]]]
    options: dict[str, Any]

    @property
    def layout(self):
        return self.backend.layout

    def assemble_past(self, order: Sequence[int] | None = None) -> tuple[list[LayerKV], int]:
        """Root KV followed by the antecedents (each relocated + its own patches) in ``order``.
        Returns the per-layer past ``[H, S, d]`` and the next free position. A caller that already
        holds the assembled KV (a window) passes it as ``past=`` to skip re-placing the antecedents."""
        given = self.options.get("past")
        if given is not None and (order is None or list(order) == list(range(len(self.antecedents)))):
            return given, self.backend.root_len + sum(ch.span for ch, _ in self.antecedents)
        root = self.backend.root_kv()
        parts: list[list[LayerKV]] = [root]
        pos = self.backend.root_len
        for idx in order if order is not None else range(len(self.antecedents)):
            ch, patches = self.antecedents[idx]
            parts.append(relocate(ch, pos, layout=self.layout, patch=patches or None))
            pos += ch.span
        return concat_kv(parts), pos

    def conditioned_content(self, order: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One conditioned forward: B prefilled after root + antecedents; returns B's KV(B|A) in the
        content frame, fp32 ``keys [L,H_k,T,d_k]``, ``values [L,H_v,T,d_v]``. A caller that already
        ran that forward passes its result as ``conditioned=(keys, values)`` (no forward then)."""
        given = self.options.get("conditioned")
        if given is not None and order is None:
            return given[0].to(torch.float32), given[1].to(torch.float32)
        past, start = self.assemble_past(order)
        pos = self.chunk.positions(start)
        inputs = self.backend.chunk_inputs(self.chunk)
        res = self.backend.forward(**inputs, positions=pos, past=past, logits="none")
        return to_content_frame(res.kv, self.layout, pos)

    def deltas_against(self, keys: torch.Tensor, values: torch.Tensor, base: Sequence[Patch] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Δ in the content frame, flattened per layer: ``dK [L, T, H_k*d_k]``, ``dV [L, T, H_v*d_v]``,
        relative to the canonical plus the ``base`` patches' corrections."""
        ref_k = self.chunk.keys.to(torch.float32).clone()
        ref_v = self.chunk.values.to(torch.float32).clone()
        for p in base:
            for l in p.layers:
                dk, dv = p.layer_delta(l)
                ref_k[l] += dk
                ref_v[l] += dv
        dk = (keys - ref_k).transpose(1, 2).reshape(keys.shape[0], keys.shape[2], -1)
        dv = (values - ref_v).transpose(1, 2).reshape(values.shape[0], values.shape[2], -1)
        return dk, dv


class PatchKind(Registered):
    """Base class of a patch variant. Subclasses set ``name`` and override one or both hooks."""

    registry = PATCH_KINDS
    name: ClassVar[str] = ""
    ordered: ClassVar[bool] = True  # whether the antecedent order is part of the signature
    #: a correction on top of the chunk's current patches (formed with them as ``current=``, keyed
    #: by them, stacked on them when applied): it replaces the conditioning only at full rank
    stacked: ClassVar[bool] = False
    #: the kind whose stored patches this one shares (None: its own); kinds that measure the same
    #: thing share one store namespace
    stored_as: ClassVar[str | None] = None
    #: measures exactly KV(B | the ordered antecedents): a valid target for placement scheduling
    exact_on_prefix: ClassVar[bool] = False

    @classmethod
    def store_kind(cls) -> str:
        return cls.stored_as or cls.name

    def target(self, ctx: FormContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Δ to factorize: ``dK [L, T, F_k]``, ``dV [L, T, F_v]``. Default: one conditioned forward."""
        keys, values = ctx.conditioned_content()
        return ctx.deltas_against(keys, values)

    @classmethod
    def signature_extra(cls, base_ids: Sequence[str]) -> list[str]:
        """What besides the antecedents decides this patch's meaning (folded into its antecedent
        signature, hence its id and store key): for a ``stacked`` kind, the ids of the patches it
        is stacked on (two corrections on the same antecedents but different bases differ);
        nothing otherwise."""
        return [f"stacked-on:{b}" for b in base_ids] if cls.stacked else []

    def layers(self, ctx: FormContext) -> tuple[int, ...]:
        """Which layers carry factors. Default: all."""
        return tuple(range(ctx.chunk.num_layers))

    def factorize(
        self, ctx: FormContext, dk: torch.Tensor, dv: torch.Tensor, rank_k: int, rank_v: int, layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str | None]:
        """Top-m factors per layer (:func:`~contextdeque.patch.topm.truncated_svd`, batched over
        the layers). Returns ``k_u [n,T,m_k], k_w [n,m_k,F_k], v_u, v_w, basis_id``."""
        if not layers:
            return (*([torch.zeros(0, 0, 0)] * 4), None)
        index = list(layers)
        checkpoint()  # background formation gives way to foreground work, K and V apart
        if kv_in_one_call(dk, dv, rank_k, rank_v):  # (CUDA settings: one batch, one set of host round trips)
            us, vt = truncated_svd(torch.cat([dk[index], dv[index]]), rank_k)
            return us[:len(index)], vt[:len(index)], us[len(index):], vt[len(index):], None
        k_u, k_w = truncated_svd(dk[index], rank_k)
        checkpoint()
        v_u, v_w = truncated_svd(dv[index], rank_v)
        return k_u, k_w, v_u, v_w, None


def factor_dtype(storage: torch.dtype, factors: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype a patch's factors are stored in: the chunk's storage dtype, except that float16
    factors that would overflow (``U_m S_m`` carries Δ's singular values, which can pass 65504
    while every K/V entry is inside float16's range) are kept in float32 instead of turning into
    inf."""
    if storage == torch.float16 and any(t.numel() and float(t.abs().amax()) > FP16_MAX for t in factors):
        return torch.float32
    return storage


def _normalize_antecedents(
    antecedents: Sequence[Any], store: Any, backend: "HFBackend"
) -> list[tuple[Chunk, list[Patch]]]:
    if isinstance(antecedents, (str, bytes, Chunk)) or not isinstance(antecedents, Sequence):
        raise ArgumentTypeError(
            f"antecedents must be a sequence (of Chunks, stored chunk ids or (Chunk, patches) pairs), "
            f"got {type(antecedents).__name__}"
        )
    out: list[tuple[Chunk, list[Patch]]] = []
    for a in antecedents:
        patches: list[Patch] = []
        if isinstance(a, tuple):
            if len(a) != 2:
                raise PatchError(f"an antecedent pair is (Chunk, patches), got a tuple of {len(a)}")
            a, ps = a
            if isinstance(ps, Patch):
                patches = [ps]
            elif ps:
                if not isinstance(ps, (list, tuple)) or not all(isinstance(x, Patch) for x in ps):
                    raise ArgumentTypeError(f"an antecedent's patches must be Patches, got {type(ps).__name__}")
                patches = list(ps)
        if isinstance(a, str):
            found = store.get_chunk(a) if store is not None else None
            if found is None:
                raise PatchError(f"antecedent chunk {a[:12]} is not in the store")
            a = found
        if not isinstance(a, Chunk):
            raise PatchError(f"antecedents must be Chunks or stored chunk ids, got {type(a).__name__}")
        if a.fingerprint != backend.fingerprint:
            raise FingerprintMismatchError(f"antecedent {a.id[:12]} was encoded by another model")
        out.append((a, patches))
    return out


def form_patch(
    backend: "HFBackend",
    chunk: Chunk,
    antecedents: Sequence[Any] = (),
    rank: int | str | None = DEFAULT_RANK,
    kind: str = "exact",
    *,
    rank_v: int | str | None = None,
    store: Any = None,
    energy: float | None = None,
    fidelity: Any = None,
    **options: Any,
) -> Patch:
    """Form a conditioning patch for ``chunk`` on ``antecedents`` (in window order).

    ``antecedents``: Chunks, stored chunk ids (looked up in ``store``), or ``(Chunk, patch(es))``
    pairs when an antecedent itself carries a correction. ``rank``: K rank (``"full"`` =
    min(T, F)); ``rank_v`` defaults to ``rank``. ``kind``: one of ``PATCH_KINDS`` (exact, orbit,
    removal, recall, deep, shared). Options are passed to the kind (e.g. ``deep_layers=``,
    ``basis=``, ``current=``, ``max_orderings=``, ``past=`` — the already assembled per-layer KV
    ``[H, S, d]`` of root + antecedents, which skips re-placing them). ``fidelity``: a
    :class:`~contextdeque.patch.alloc.FidelityRule`: per-layer K and V ranks (at most ``rank`` /
    ``rank_v`` each) allocated where Δ's energy is until its energy target is captured, within
    its byte cap (what it decided: ``patch.meta["fidelity"]``); ``energy``: shorthand for a rule
    with that energy target and no byte cap. Costs one conditioned forward (orbit: one per
    ordering).
    """
    if not all(hasattr(backend, a) for a in ("forward", "layout", "fingerprint")):
        raise ArgumentTypeError(f"backend must be an HFBackend, got {type(backend).__name__}")
    check_instance("chunk", chunk, Chunk, "a Chunk")
    check_str("kind", kind)
    for name, r in (("rank", rank), ("rank_v", rank_v)):
        if not is_full(r):
            check_int(name, r, minimum=0, error=PatchError)
    check_float("energy", energy, minimum=0.0, maximum=1.0, open_min=True, none_ok=True, error=PatchError)
    if fidelity is not None and not callable(getattr(fidelity, "shape", None)):
        raise ArgumentTypeError(f"fidelity must be a FidelityRule, got {type(fidelity).__name__}")
    if kind not in PATCH_KINDS:
        raise PatchError(f"unknown patch kind {kind!r}; known: {sorted(PATCH_KINDS)}")
    if chunk.fingerprint != backend.fingerprint or chunk.layout_signature != backend.layout.signature:
        raise FingerprintMismatchError(f"chunk {chunk.id[:12]} was encoded by another model")
    ants = _normalize_antecedents(antecedents, store, backend)
    lay = backend.layout
    T = chunk.n_tokens
    fk, fv = lay.k_heads * lay.k_dim, lay.v_heads * lay.v_dim
    rk = resolve_rank(rank, T, fk, "K")
    rv = resolve_rank(rank if rank_v is None else rank_v, T, fv, "V")
    impl = PATCH_KINDS[kind]()
    ctx = FormContext(backend=backend, chunk=chunk, antecedents=ants, options=options)
    dk, dv = impl.target(ctx)
    layers = impl.layers(ctx)
    k_u, k_w, v_u, v_w, basis_id = impl.factorize(ctx, dk, dv, rk, rv, layers)
    if layers:
        # record the rank actually kept (a shared basis may hold fewer directions than asked)
        rk, rv = int(k_u.shape[-1]), int(v_u.shape[-1])
    ids = [c.id for c, _ in ants]
    patch = new_patch(
        chunk, kind=kind, antecedents=ids,
        signature=patch_signature(kind, ids, base_ids=[p.id for p in options.get("current", ())]),
        ranks=(rk, rv), layers=layers, factors=(k_u, k_w, v_u, v_w), layout=lay, dtype=chunk.storage_dtype,
        basis_id=basis_id,
        meta={k: str(v) for k, v in options.items() if isinstance(v, (int, float, str)) and k != "past"},
    )
    if fidelity is None and energy is not None:
        from .alloc import FidelityRule  # alloc builds on this module

        fidelity = FidelityRule(energy=float(energy))
    # the allocation cuts the patch formed at the caps, per layer, where Δ's energy is
    return patch if fidelity is None else fidelity.shape(patch, chunk)
