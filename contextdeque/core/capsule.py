"""Compressed-at-rest chunks: KVCapsule's linear variant.

A chunk may be stored compressed along the token axis, per layer and KV head:

- keys: a retained row subset ``K[M]`` (``r = ceil(rho_l T)`` rows) and a linear reconstruction
  ``K_hat = A K[M]`` (``A [T, r]``, retained rows reproduced exactly). ``M`` is chosen by
  pivoted QR over the calibration keys (the rows that best span the rest) and ``A`` by ridge
  least squares over them — the paper's MLP reconstructor replaced by its linear core;
- values: the chunk's token-mean ``mu [1, d]`` plus coefficients ``C = U (V - 1 mu)`` on a
  token-axis PCA basis ``U [r, T]`` (orthonormal rows: the top ``r`` left singular vectors of
  the centred calibration values); ``V_hat = U^T C + 1 mu``.

The basis (:class:`CapsuleBasis`) is fitted on a calibration set of chunks from the model, one
chunk length ``T`` per basis, with a pyramid retention schedule (more rows in early layers, the
paper's section 2.4), and saved as safetensors with the model fingerprint, layout signature,
chunk length and a checksum. Everything happens in the content frame, so reconstruction
commutes with relocation: reconstruct, then rotate from the content frame as for any chunk; a
patch formed on the uncompressed canonical adds on top of the reconstruction
(``relocate(reconstruct(c), start, patch=p)``). At full retention (``rho = 1``) the basis is
the identity and reconstruction is exact, bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import torch

from .chunk import Chunk, digest
from .errors import CapsuleError, CorruptEntryError, FingerprintMismatchError
from .kv import tensor_nbytes

FORMAT = "contextdeque-capsule-basis-1"
DEFAULT_RETENTION = 0.4  # mean kept fraction: the paper's ~60% compression
DEFAULT_SPREAD = 0.5  # pyramid: layer 0 keeps (1 + spread) x mean, the last layer (1 - spread) x mean
DEFAULT_RIDGE = 1e-6  # key-map ridge, relative to the retained rows' mean energy


def pyramid(num_layers: int, mean: float = DEFAULT_RETENTION, spread: float = DEFAULT_SPREAD) -> list[float]:
    """Per-layer retention ratios, linear from ``mean (1 + spread)`` at layer 0 down to
    ``mean (1 - spread)`` at the last layer, clipped to ``(0, 1]`` (all ones at ``mean = 1``)."""
    if not 0.0 < float(mean) <= 1.0:
        raise CapsuleError(f"retention must lie in (0, 1], got {mean}")
    if not 0.0 <= float(spread) < 1.0:
        raise CapsuleError(f"spread must lie in [0, 1), got {spread}")
    if num_layers == 1 or float(mean) == 1.0:
        return [float(mean)] * num_layers
    hi, lo = mean * (1 + spread), mean * (1 - spread)
    return [min(1.0, hi + (lo - hi) * l / (num_layers - 1)) for l in range(num_layers)]


def kept_rows(retention: float, n_tokens: int) -> int:
    """``ceil(rho T)`` rows (at least one)."""
    return max(1, min(n_tokens, int(math.ceil(float(retention) * n_tokens - 1e-9))))


def pivoted_rows(gram: torch.Tensor, r: int) -> torch.Tensor:
    """The ``r`` rows a column-pivoted QR of ``X^T`` picks first, from the Gram matrix
    ``gram = X X^T`` (``[B, T, T]``): greedily the row with the largest residual norm after
    projecting out the rows already taken (pivoted Cholesky). ``[B, r]`` int64, pick order."""
    G = gram.to(torch.float64)
    B, T, _ = G.shape
    r = min(int(r), T)
    picked = torch.empty(B, r, dtype=torch.long)
    Lf = torch.zeros(B, T, r, dtype=torch.float64)
    diag = G.diagonal(dim1=1, dim2=2).clone()
    taken = torch.zeros(B, T, dtype=torch.bool)
    ar = torch.arange(B)
    for j in range(r):
        p = diag.masked_fill(taken, -math.inf).argmax(-1)
        picked[:, j] = p
        taken[ar, p] = True
        col = G[ar, :, p] - (Lf[:, :, :j] @ Lf[ar, p, :j].unsqueeze(-1)).squeeze(-1)  # [B, T]
        piv = diag[ar, p].clamp_min(1e-300).sqrt()
        Lf[:, :, j] = col / piv.unsqueeze(-1)
        diag = (diag - Lf[:, :, j] ** 2).clamp_min(0.0)
    return picked


@dataclass
class CalibrationStats:
    """What a basis is fitted from: per layer and KV head the calibration chunks' token Gram
    matrices ``key_gram = sum_c K_c K_c^T`` and ``value_gram = sum_c V_c V_c^T`` (``[L, H, T, T]``
    fp64; content frame). Chunks' first ``T'`` rows have the top-left ``T' x T'`` blocks as
    Grams, so one set of long calibration chunks serves every shorter length (:meth:`prefix`)."""

    fingerprint: str
    layout_signature: str
    modality: str
    n_chunks: int
    key_gram: torch.Tensor
    value_gram: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return int(self.key_gram.shape[-1])

    @classmethod
    @torch.no_grad()
    def from_chunks(cls, chunks: Sequence[Chunk]) -> "CalibrationStats":
        if not chunks:
            raise CapsuleError("fitting a capsule basis needs at least one calibration chunk")
        c0 = chunks[0]
        for c in chunks:
            if not isinstance(c, Chunk):
                raise CapsuleError(f"calibration chunks must be Chunks, got {type(c).__name__}")
            if c.fingerprint != c0.fingerprint or c.layout_signature != c0.layout_signature:
                raise FingerprintMismatchError("calibration chunks come from different models or layouts")
            if c.n_tokens != c0.n_tokens or c.num_layers != c0.num_layers:
                raise CapsuleError(f"calibration chunks must share one length (got {c0.n_tokens} and {c.n_tokens})")
        kg = sum(c.keys.to(torch.float64) @ c.keys.to(torch.float64).transpose(-1, -2) for c in chunks)
        vg = sum(c.values.to(torch.float64) @ c.values.to(torch.float64).transpose(-1, -2) for c in chunks)
        return cls(c0.fingerprint, c0.layout_signature, c0.modality, len(chunks), kg, vg)

    def prefix(self, n_tokens: int) -> "CalibrationStats":
        """The stats of the calibration chunks' first ``n_tokens`` rows."""
        T = int(n_tokens)
        if not 1 <= T <= self.n_tokens:
            raise CapsuleError(f"calibration chunks hold {self.n_tokens} tokens; cannot fit chunks of {T}")
        return replace(self, key_gram=self.key_gram[..., :T, :T], value_gram=self.value_gram[..., :T, :T])


@dataclass
class CapsuleChunk:
    """A chunk stored compressed (see the module docstring). Per layer ``l`` with ``r_l`` kept:

    ``keys_kept[l]`` ``[H_k, r_l, d_k]``: the retained key rows (content frame);
    ``value_coeff[l]`` ``[H_v, r_l, d_v]`` and ``value_mean[l]`` ``[H_v, 1, d_v]``: the values'
    basis coefficients and token-mean (the mean is zeros at full retention).
    ``chunk_meta``: the chunk's identity and inputs (id, fingerprint, layout, root, span,
    positions, token ids or embeddings, storage dtype). ``basis_id``: the basis it needs.
    """

    basis_id: str
    n_tokens: int
    keys_kept: list[torch.Tensor]
    value_coeff: list[torch.Tensor]
    value_mean: list[torch.Tensor]
    chunk_meta: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.chunk_meta["id"]

    @property
    def fingerprint(self) -> str:
        return self.chunk_meta["fingerprint"]

    @property
    def layout_signature(self) -> str:
        return self.chunk_meta["layout_signature"]

    @property
    def num_layers(self) -> int:
        return len(self.keys_kept)

    @property
    def nbytes(self) -> int:
        """Stored KV bytes (kept keys, value coefficients and means), as ``Chunk.nbytes`` counts a page."""
        return sum(tensor_nbytes(t) for ts in (self.keys_kept, self.value_coeff, self.value_mean) for t in ts)

    def to_entry(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Flat tensors + string metadata for a store (kind ``"capsule"``)."""
        tensors: dict[str, torch.Tensor] = {}
        for l in range(self.num_layers):
            tensors[f"l{l}.k"] = self.keys_kept[l]
            tensors[f"l{l}.vc"] = self.value_coeff[l]
            tensors[f"l{l}.vm"] = self.value_mean[l]
        extra = {}
        for name in ("rel_positions", "token_ids", "embeds"):
            t = self.chunk_meta.get(name)
            if t is not None:
                tensors[name] = t
        for k, v in self.chunk_meta.items():
            if k not in ("rel_positions", "token_ids", "embeds"):
                extra[k] = v
        meta = {
            "kind": "capsule",
            "id": self.id,
            "fingerprint": self.fingerprint,
            "layout": self.layout_signature,
            "basis_id": self.basis_id,
            "n_tokens": str(self.n_tokens),
            "num_layers": str(self.num_layers),
            "content_digest": digest(self.id, self.basis_id)[:32],
            "chunk": json.dumps(extra, sort_keys=True),
        }
        return tensors, meta

    @staticmethod
    def chunk_entry_meta(meta: "dict[str, str] | Any") -> dict[str, str]:
        """The metadata of the reconstructed chunk's store entry (``Chunk.to_entry``), from a
        capsule entry's metadata alone (what a compressing tier's ``peek`` answers)."""
        try:
            if meta.get("kind") != "capsule":
                raise KeyError("kind")
            cm = json.loads(meta["chunk"])
            return {
                "kind": "chunk", "id": meta["id"], "fingerprint": meta["fingerprint"], "layout": meta["layout"],
                "root_digest": cm["root_digest"], "span": str(cm["span"]), "canonical_start": str(cm["canonical_start"]),
                "modality": cm["modality"], "content_digest": meta["id"],
                "extra": json.dumps({**cm["meta"], "capsule_basis": meta["basis_id"]}, sort_keys=True),
            }
        except (KeyError, ValueError, TypeError) as exc:
            raise CorruptEntryError(f"stored capsule entry is malformed: {exc}") from exc

    @classmethod
    def from_entry(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> "CapsuleChunk":
        try:
            if meta.get("kind") != "capsule":
                raise KeyError("kind")
            L = int(meta["num_layers"])
            cm: dict[str, Any] = json.loads(meta["chunk"])
            for name in ("rel_positions", "token_ids", "embeds"):
                cm[name] = tensors.get(name)
            return cls(
                basis_id=meta["basis_id"],
                n_tokens=int(meta["n_tokens"]),
                keys_kept=[tensors[f"l{l}.k"] for l in range(L)],
                value_coeff=[tensors[f"l{l}.vc"] for l in range(L)],
                value_mean=[tensors[f"l{l}.vm"] for l in range(L)],
                chunk_meta=cm,
            )
        except (KeyError, ValueError) as exc:
            raise CorruptEntryError(f"stored capsule entry is malformed: {exc}") from exc


@dataclass
class CapsuleBasis:
    """A fitted compression basis for chunks of ``n_tokens`` tokens of one model.

    Per layer ``l`` (``r_l = kept_rows(retention[l], T)``): ``key_rows[l]`` ``[H_k, r_l]`` int64
    retained rows (ascending), ``key_map[l]`` ``[H_k, T, r_l]`` fp32 (``A``), ``value_basis[l]``
    ``[H_v, r_l, T]`` fp32 (``U``, orthonormal rows). ``retention[l] == 1`` layers are exact
    (identity, no centring).
    """

    fingerprint: str
    layout_signature: str
    n_tokens: int
    retention: tuple[float, ...]
    key_rows: list[torch.Tensor]
    key_map: list[torch.Tensor]
    value_basis: list[torch.Tensor]
    modality: str = "text"
    n_calibration: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.key_rows)

    def full(self, layer: int) -> bool:
        return self.key_rows[layer].shape[1] == self.n_tokens

    @cached_property
    def id(self) -> str:
        """Content hash of the basis (a capsule records the one it was compressed with)."""
        return digest(self.fingerprint, self.layout_signature, self.n_tokens, list(self.retention),
                      *self.key_rows, *self.key_map, *self.value_basis)[:32]

    @property
    def nbytes(self) -> int:
        return sum(tensor_nbytes(t) for ts in (self.key_rows, self.key_map, self.value_basis) for t in ts)

    # ------------------------------------------------------------------ checks
    def check_chunk(self, fingerprint: str, layout_signature: str, n_tokens: int, num_layers: int, what: str) -> None:
        if fingerprint != self.fingerprint or layout_signature != self.layout_signature:
            raise FingerprintMismatchError(
                f"{what} belongs to model {fingerprint[:12]} (layout {layout_signature}); this capsule basis was "
                f"fitted for {self.fingerprint[:12]} ({self.layout_signature})"
            )
        if n_tokens != self.n_tokens:
            raise CapsuleError(f"{what} holds {n_tokens} tokens; this capsule basis was fitted for chunks of {self.n_tokens}")
        if num_layers != self.num_layers:
            raise CapsuleError(f"{what} has {num_layers} layers; this capsule basis has {self.num_layers}")

    # ------------------------------------------------------------------ compress / reconstruct
    @torch.no_grad()
    def compress(self, chunk: Chunk) -> CapsuleChunk:
        """``chunk`` (content frame) -> its capsule, in the chunk's storage dtype."""
        if not isinstance(chunk, Chunk):
            raise CapsuleError(f"compress takes a Chunk, got {type(chunk).__name__}")
        self.check_chunk(chunk.fingerprint, chunk.layout_signature, chunk.n_tokens, chunk.num_layers, f"chunk {chunk.id[:12]}")
        sdt = chunk.storage_dtype
        kk, vc, vm = [], [], []
        for l in range(self.num_layers):
            k, v = chunk.layer(l)
            if k.shape[0] != self.key_rows[l].shape[0] or v.shape[0] != self.value_basis[l].shape[0]:
                raise CapsuleError(f"layer {l}: chunk has {k.shape[0]}/{v.shape[0]} K/V heads, the basis "
                                   f"{self.key_rows[l].shape[0]}/{self.value_basis[l].shape[0]}")
            rows = self.key_rows[l]
            kk.append(torch.gather(k, 1, rows.unsqueeze(-1).expand(-1, -1, k.shape[-1])).to(sdt).contiguous())
            if self.full(l):
                vc.append(v.to(sdt).contiguous())
                vm.append(torch.zeros(v.shape[0], 1, v.shape[-1], dtype=sdt))
            else:
                v32 = v.to(torch.float32)
                mu = v32.mean(1, keepdim=True)
                vc.append((self.value_basis[l] @ (v32 - mu)).to(sdt).contiguous())
                vm.append(mu.to(sdt).contiguous())
        cm = {
            "id": chunk.id, "fingerprint": chunk.fingerprint, "layout_signature": chunk.layout_signature,
            "root_digest": chunk.root_digest, "span": chunk.span, "canonical_start": chunk.canonical_start,
            "modality": chunk.modality, "meta": dict(chunk.meta), "storage_dtype": str(sdt).replace("torch.", ""),
            "rel_positions": chunk.rel_positions, "token_ids": chunk.token_ids, "embeds": chunk.embeds,
        }
        return CapsuleChunk(basis_id=self.id, n_tokens=chunk.n_tokens, keys_kept=kk, value_coeff=vc, value_mean=vm, chunk_meta=cm)

    @torch.no_grad()
    def reconstruct(self, capsule: CapsuleChunk) -> Chunk:
        """The capsule's chunk (content frame, the original's storage dtype and id; ``meta``
        records ``capsule_basis``). Exact at full retention."""
        if not isinstance(capsule, CapsuleChunk):
            raise CapsuleError(f"reconstruct takes a CapsuleChunk, got {type(capsule).__name__}")
        self.check_chunk(capsule.fingerprint, capsule.layout_signature, capsule.n_tokens, capsule.num_layers,
                         f"capsule of chunk {capsule.id[:12]}")
        if capsule.basis_id != self.id:
            raise CapsuleError(f"capsule of chunk {capsule.id[:12]} was compressed with basis {capsule.basis_id[:12]}, "
                               f"not {self.id[:12]}")
        cm = capsule.chunk_meta
        sdt = getattr(torch, cm["storage_dtype"])
        keys, values = [], []
        for l in range(self.num_layers):
            kept = capsule.keys_kept[l]
            if self.full(l):
                keys.append(kept.to(sdt))
                values.append(capsule.value_coeff[l].to(sdt))
                continue
            rows = self.key_rows[l]
            k = (self.key_map[l] @ kept.to(torch.float32)).to(sdt)
            k.scatter_(1, rows.unsqueeze(-1).expand(-1, -1, kept.shape[-1]), kept.to(sdt))  # retained rows: exact
            keys.append(k)
            v = self.value_basis[l].transpose(1, 2) @ capsule.value_coeff[l].to(torch.float32) + capsule.value_mean[l].to(torch.float32)
            values.append(v.to(sdt))
        return Chunk(
            id=cm["id"], fingerprint=cm["fingerprint"], layout_signature=cm["layout_signature"],
            root_digest=cm["root_digest"], keys=torch.stack(keys).contiguous(), values=torch.stack(values).contiguous(),
            rel_positions=cm["rel_positions"], span=int(cm["span"]), canonical_start=int(cm["canonical_start"]),
            token_ids=cm["token_ids"], embeds=cm["embeds"], modality=cm["modality"],
            meta={**cm["meta"], "capsule_basis": capsule.basis_id},
        )

    def relocate(self, capsule: CapsuleChunk, start: int, **kw: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Reconstruct in the content frame, then place exactly like any chunk (``relocate``
        keywords, e.g. ``patch=``)."""
        from .operator import relocate

        return relocate(self.reconstruct(capsule), start, **kw)

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the basis as safetensors (atomic: temp file + rename) with the model fingerprint,
        layout, chunk length, retention and a checksum over everything in the header."""
        import safetensors.torch

        tensors: dict[str, torch.Tensor] = {}
        for l in range(self.num_layers):
            tensors[f"l{l}.rows"] = self.key_rows[l].contiguous()
            tensors[f"l{l}.kmap"] = self.key_map[l].contiguous()
            tensors[f"l{l}.vbasis"] = self.value_basis[l].contiguous()
        meta = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "layout": self.layout_signature,
            "n_tokens": str(self.n_tokens),
            "num_layers": str(self.num_layers),
            "retention": json.dumps(list(self.retention)),
            "modality": self.modality,
            "n_calibration": str(self.n_calibration),
        }
        meta["checksum"] = _checksum(meta, tensors)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".capsule-", suffix=".part", dir=path.parent)
        os.close(fd)
        try:
            safetensors.torch.save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        fingerprint: str | None = None,
        layout_signature: str | None = None,
        n_tokens: int | None = None,
    ) -> "CapsuleBasis":
        """Read a saved basis, verified by its checksum (``CorruptEntryError`` otherwise), and
        refuse one fitted for another model / layout (``FingerprintMismatchError``) or chunk
        length (``CapsuleError``) than the expected ones given."""
        import safetensors
        import safetensors.torch

        path = Path(path)
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                meta = dict(f.metadata() or {})
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except FileNotFoundError:
            raise
        except Exception as exc:  # SafetensorError, truncated headers, bad JSON
            raise CorruptEntryError(f"capsule basis {path} is not a readable safetensors file ({exc})") from None
        if meta.get("format") != FORMAT:
            raise CorruptEntryError(f"{path} is not a capsule basis (format {meta.get('format')!r})")
        want = meta.pop("checksum", None)
        if want != _checksum(meta, tensors):
            raise CorruptEntryError(f"capsule basis {path} failed its checksum (corrupt or edited)")
        try:
            L = int(meta["num_layers"])
            basis = cls(
                fingerprint=meta["fingerprint"],
                layout_signature=meta["layout"],
                n_tokens=int(meta["n_tokens"]),
                retention=tuple(float(x) for x in json.loads(meta["retention"])),
                key_rows=[tensors[f"l{l}.rows"] for l in range(L)],
                key_map=[tensors[f"l{l}.kmap"] for l in range(L)],
                value_basis=[tensors[f"l{l}.vbasis"] for l in range(L)],
                modality=meta.get("modality", "text"),
                n_calibration=int(meta.get("n_calibration", "0")),
            )
        except (KeyError, ValueError) as exc:
            raise CorruptEntryError(f"capsule basis {path} is malformed: {exc}") from None
        if fingerprint is not None and basis.fingerprint != fingerprint or (
            layout_signature is not None and basis.layout_signature != layout_signature
        ):
            raise FingerprintMismatchError(
                f"capsule basis {path} was fitted for model {basis.fingerprint[:12]} (layout {basis.layout_signature}), "
                f"not {str(fingerprint)[:12]} ({layout_signature})"
            )
        if n_tokens is not None and basis.n_tokens != int(n_tokens):
            raise CapsuleError(f"capsule basis {path} was fitted for chunks of {basis.n_tokens} tokens, not {n_tokens}")
        return basis


def _checksum(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    return digest({k: v for k, v in sorted(meta.items()) if k != "checksum"}, *(tensors[k] for k in sorted(tensors)),
                  sorted(tensors))


def ridge_solve(gram: torch.Tensor, rhs: torch.Tensor, ridge: float) -> torch.Tensor:
    """``(gram + lam I)^-1 rhs`` for symmetric PSD ``gram [B, r, r]`` and ``rhs [B, r, n]``, float64,
    with ``lam = ridge * mean(diag(gram))`` per batch entry.

    A calibration set whose keys span fewer than ``r`` directions (fewer tokens than rows, repeated
    or constant rows, an all-zero head) makes ``gram`` singular, and the ridge alone may not lift it
    above rounding: a Cholesky factorisation that fails or yields non-finite values falls back to
    the pseudo-inverse (eigenvalues below ``r * eps * largest`` dropped: the least-squares map on the
    directions the calibration spans). Never an LU solve, which LAPACK builds may reject on a
    singular matrix. Raises ``CapsuleError`` when even that is not finite."""
    G = gram.to(torch.float64)
    rhs = rhs.to(torch.float64)
    if not (bool(torch.isfinite(G).all()) and bool(torch.isfinite(rhs).all())):
        raise CapsuleError("the capsule key map could not be fitted: its Gram holds non-finite values")
    r = G.shape[-1]
    eye = torch.eye(r, dtype=torch.float64)
    lam = ridge * G.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(0.0)
    G = G + lam[..., None, None] * eye
    factor, info = torch.linalg.cholesky_ex(G)
    if bool((info == 0).all()):
        out = torch.cholesky_solve(rhs, factor)
        if bool(torch.isfinite(out).all()):
            return out
    try:
        w, V = torch.linalg.eigh(G)
    except RuntimeError as exc:  # torch's LinAlgError: LAPACK did not converge
        raise CapsuleError(f"the capsule key map could not be fitted: {exc}") from exc
    cutoff = w.amax(-1, keepdim=True).clamp_min(0.0) * (r * torch.finfo(torch.float64).eps)
    inv = torch.where(w > cutoff, 1.0 / w.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(w))
    out = V @ (inv[..., None] * (V.transpose(-1, -2) @ rhs))
    if not bool(torch.isfinite(out).all()):
        raise CapsuleError("the capsule key map could not be fitted: its least-squares solve is not finite")
    return out


@torch.no_grad()
def fit_capsule(
    calibration: "Sequence[Chunk] | CalibrationStats",
    retention: float | Sequence[float] = DEFAULT_RETENTION,
    *,
    spread: float = DEFAULT_SPREAD,
    ridge: float = DEFAULT_RIDGE,
) -> CapsuleBasis:
    """Fit a basis on calibration chunks (same model, layout and length ``T``) or their
    :class:`CalibrationStats`.

    ``retention``: the mean kept fraction of a :func:`pyramid` schedule with ``spread``, or one
    ratio per layer. Per layer and KV head: keys — the pivoted-QR row subset ``M`` of the stacked
    calibration keys and the ridge least-squares map ``A = G[:, M] (G[M, M] + lam I)^-1``
    (``G`` the key Gram); values — the top eigenvectors of the token-centred value Gram
    ``J G_V J`` (``J = I - 11^T / T``: each chunk's values centred along its tokens), i.e. the top
    left singular vectors of the centred calibration values.
    """
    stats = calibration if isinstance(calibration, CalibrationStats) else CalibrationStats.from_chunks(list(calibration))
    if not (torch.isfinite(stats.key_gram).all() and torch.isfinite(stats.value_gram).all()):
        raise CapsuleError("the calibration Grams hold non-finite values: no basis can be fitted from them")
    L, Hk, T = stats.key_gram.shape[0], stats.key_gram.shape[1], stats.n_tokens
    Hv = stats.value_gram.shape[1]
    if isinstance(retention, (int, float)):
        sched = pyramid(L, float(retention), spread)
    else:
        sched = [float(x) for x in retention]
        if len(sched) != L or any(not 0.0 < x <= 1.0 for x in sched):
            raise CapsuleError(f"retention needs {L} ratios in (0, 1], got {retention}")
    rs = [kept_rows(x, T) for x in sched]
    partial = [l for l in range(L) if rs[l] < T]
    picks = None
    if partial:
        # one greedy pivoting pass for every layer and head: the first r picks of a longer pass
        # are the picks of a pass of length r
        G = stats.key_gram[partial].reshape(len(partial) * Hk, T, T)
        picks = pivoted_rows(G, max(rs[l] for l in partial)).view(len(partial), Hk, -1)
    J = torch.eye(T, dtype=torch.float64) - 1.0 / T
    eye32 = torch.eye(T, dtype=torch.float32)
    rows_l, maps_l, basis_l = [], [], []
    for l in range(L):
        r = rs[l]
        if r >= T:
            rows_l.append(torch.arange(T).unsqueeze(0).expand(Hk, -1).contiguous())
            maps_l.append(eye32.unsqueeze(0).expand(Hk, -1, -1).contiguous())
            basis_l.append(eye32.unsqueeze(0).expand(Hv, -1, -1).contiguous())
            continue
        G = stats.key_gram[l]  # [H_k, T, T]
        rows = torch.sort(picks[partial.index(l), :, :r], dim=1).values  # [H_k, r]
        cross = torch.gather(G, 2, rows.unsqueeze(1).expand(-1, T, -1))  # G[:, :, M]  [H_k, T, r]
        GMM = torch.gather(cross, 1, rows.unsqueeze(-1).expand(-1, -1, r))  # [H_k, r, r]
        A = ridge_solve(GMM, cross.transpose(1, 2), ridge).transpose(1, 2)  # [H_k, T, r] (GMM symmetric)
        rows_l.append(rows)
        maps_l.append(A.to(torch.float32).contiguous())
        C = J @ stats.value_gram[l] @ J  # [H_v, T, T]
        _, vecs = torch.linalg.eigh(C)  # ascending eigenvalues
        U = vecs.flip(-1)[..., :r]  # [H_v, T, r] top components
        basis_l.append(U.transpose(1, 2).to(torch.float32).contiguous())
    return CapsuleBasis(
        fingerprint=stats.fingerprint, layout_signature=stats.layout_signature, n_tokens=T, retention=tuple(sched),
        key_rows=rows_l, key_map=maps_l, value_basis=basis_l, modality=stats.modality, n_calibration=stats.n_chunks,
    )


def reconstruction_error(original: Chunk, rebuilt: Chunk) -> tuple[float, float]:
    """Relative Frobenius error ``||X_hat - X|| / ||X||`` of keys and of values (content frame)."""
    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        a64, b64 = a.to(torch.float64), b.to(torch.float64)
        return float((a64 - b64).norm() / b64.norm().clamp_min(1e-300))

    return rel(rebuilt.keys, original.keys), rel(rebuilt.values, original.values)


class CapsuleBank:
    """Bases by (model fingerprint, layout, chunk length, modality): one per chunk shape seen.

    ``calibrate(chunk)`` supplies calibration chunks (or their :class:`CalibrationStats`) shaped
    like a chunk that has no basis yet (fitted once, then kept); without it, a missing basis is a
    ``CapsuleError``.
    """

    def __init__(self, retention: float | Sequence[float] = DEFAULT_RETENTION, *, spread: float = DEFAULT_SPREAD,
                 calibrate: Any = None) -> None:
        if isinstance(retention, (int, float)):
            pyramid(2, float(retention), spread)  # validates
        self.retention, self.spread, self.calibrate = retention, spread, calibrate
        self._bases: dict[tuple[str, str, int, str], CapsuleBasis] = {}

    @staticmethod
    def key(chunk: Chunk) -> tuple[str, str, int, str]:
        return (chunk.fingerprint, chunk.layout_signature, chunk.n_tokens, chunk.modality)

    def add(self, basis: CapsuleBasis) -> None:
        self._bases[(basis.fingerprint, basis.layout_signature, basis.n_tokens, basis.modality)] = basis

    def __len__(self) -> int:
        return len(self._bases)

    def bases(self) -> list[CapsuleBasis]:
        return list(self._bases.values())

    def basis_for(self, chunk: Chunk) -> CapsuleBasis:
        found = self.find(chunk)
        if found is None:
            raise CapsuleError(f"no capsule basis for chunks of {chunk.n_tokens} {chunk.modality} tokens")
        return found

    def find(self, chunk: Chunk) -> CapsuleBasis | None:
        """The basis for ``chunk``'s shape, fitted now when ``calibrate`` is set; None when the
        bank has none and cannot fit one."""
        k = self.key(chunk)
        if k not in self._bases:
            if self.calibrate is None:
                return None
            cal = self.calibrate(chunk)
            basis = fit_capsule(cal if isinstance(cal, CalibrationStats) else list(cal), self.retention, spread=self.spread)
            self._bases[k] = replace(basis, modality=chunk.modality)
        return self._bases[k]

    def by_id(self, basis_id: str) -> CapsuleBasis | None:
        """The basis a capsule records (``CapsuleChunk.basis_id``), or None."""
        return next((b for b in self._bases.values() if b.id == basis_id), None)


__all__ = [
    "CalibrationStats",
    "CapsuleBank",
    "CapsuleBasis",
    "CapsuleChunk",
    "fit_capsule",
    "kept_rows",
    "pivoted_rows",
    "pyramid",
    "reconstruction_error",
]
