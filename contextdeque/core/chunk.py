"""Chunk: one piece of context's KV, computed once after the window root, stored position-free."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import CorruptEntryError, EmptyChunkError, NumericsError, StorageDtypeError
from .kv import tensor_nbytes

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
FP16_MAX = 65504.0


def storage_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Normalize a storage dtype, refusing anything that cannot hold KV faithfully."""
    if isinstance(dtype, str):
        name = dtype.replace("torch.", "")
        name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(name, name)
        if name not in STORAGE_DTYPES:
            raise StorageDtypeError(f"storage dtype {dtype!r} unsupported; use one of {sorted(STORAGE_DTYPES)}")
        return STORAGE_DTYPES[name]
    if dtype not in STORAGE_DTYPES.values():
        raise StorageDtypeError(f"storage dtype {dtype} unsupported; use one of {sorted(STORAGE_DTYPES)}")
    return dtype


def check_representable(t: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """fp16 overflows past 65504: refuse rather than store infinities."""
    if dtype == torch.float16 and t.numel() and float(t.abs().max()) > FP16_MAX:
        raise StorageDtypeError(
            f"{what} reaches |x|={float(t.abs().max()):.4g}, beyond float16's range; store as bfloat16 or float32"
        )


def check_finite(tensors: "torch.Tensor | list[torch.Tensor]", what: str) -> None:
    """Refuse inf/NaN in ``tensors``: raises ``NumericsError`` naming ``what``.

    One float32 sum per tensor (no temporary; ~20x cheaper than ``isfinite(t).all()`` on CPU): a
    sum holding any inf/NaN is non-finite, so a finite sum proves the tensor finite; only a
    non-finite sum (a real inf/NaN, or finite values summing past float32's range) pays for the
    exact elementwise test."""
    ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    for t in ts:
        if not (t.numel() and t.is_floating_point()):
            continue
        total = t.sum(dtype=torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t.sum()
        if bool(torch.isfinite(total)):
            continue
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise NumericsError(f"{what} holds {bad} non-finite value(s) (inf/NaN); refused before use")


def digest(*parts: Any) -> str:
    """sha256 over tensors (their bytes, dtype and shape) and plain values."""
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, torch.Tensor):
            t = p.detach().contiguous().cpu()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"|")
    return h.hexdigest()


TEXT_SOURCE_BYTES_PER_TOKEN = 16
"""Bytes per token a text chunk's store entry holds beside its KV: its source, ``token_ids`` and
``rel_positions`` (``[1, T]``), int64 each (what a tier budgets and `TierTraffic` counts)."""


@dataclass
class Chunk:
    """A chunk's canonical KV(B|root) in the content frame.

    Tensors (L layers, T tokens):
      - ``keys``: ``[L, H_k, T, d_k]`` storage dtype, rotary channels un-rotated (content frame)
      - ``values``: ``[L, H_v, T, d_v]`` storage dtype (for MLA under 5.18 this tensor is k_pe and
        is the one carrying the rotary channels; see ``KVLayout.rope_tensor``)
      - ``rel_positions``: ``[n_axes, T]`` int64 positions relative to the chunk's start (for text
        ``arange(T)``; for an image span the model's own t/h/w grid)
      - ``token_ids``: ``[T]`` int64 or None; ``embeds``: ``[T, hidden]`` input embeddings or None
    ``span`` is how far the chunk advances the next position (not its token count for images).
    """

    id: str
    fingerprint: str
    layout_signature: str
    root_digest: str
    keys: torch.Tensor
    values: torch.Tensor
    rel_positions: torch.Tensor
    span: int
    canonical_start: int
    token_ids: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
    modality: str = "text"
    meta: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.keys.shape[2] == 0:
            raise EmptyChunkError("a chunk must hold at least one token")
        # the one finite check of a chunk's pages: where they enter (encoded, loaded from a store,
        # cast); relocation is a rotation of finite values, so placing them needs no re-check
        check_finite([self.keys, self.values], f"the pages of chunk {self.id[:12]}")

    @property
    def n_tokens(self) -> int:
        return int(self.keys.shape[2])

    def __repr__(self) -> str:
        dt = str(self.keys.dtype).replace("torch.", "")
        span = "" if self.span == self.n_tokens else f", span {self.span}"
        return (
            f"Chunk({self.id[:10]}, {self.modality}, {self.n_tokens} tok{span}, {self.num_layers} layers, "
            f"{dt}, {format_bytes(self.nbytes)}, model {self.fingerprint[:8]})"
        )

    @property
    def num_layers(self) -> int:
        return int(self.keys.shape[0])

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the stored page (K and V, all layers)."""
        return tensor_nbytes(self.keys) + tensor_nbytes(self.values)

    def positions(self, start: int) -> torch.Tensor:
        """``[n_axes, T]`` absolute positions when the chunk starts at ``start``."""
        return self.rel_positions + int(start)

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Content-frame ``(k [H_k,T,d_k], v [H_v,T,d_v])`` of one layer."""
        return self.keys[idx], self.values[idx]

    def to(self, dtype: torch.dtype | str) -> "Chunk":
        """A copy in another storage dtype (a new chunk id: the bytes differ)."""
        dt = storage_dtype(dtype)
        check_representable(self.keys, dt, "keys")
        check_representable(self.values, dt, "values")
        out = Chunk(**{**self.__dict__, "keys": self.keys.to(dt), "values": self.values.to(dt)})
        out.id = chunk_id(self.fingerprint, self.root_digest, self.meta.get("input_digest", self.id), dt)
        return out

    # ---- serialization for stores: flat tensors + flat string metadata (safetensors header)
    def to_entry(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors = {"keys": self.keys, "values": self.values, "rel_positions": self.rel_positions}
        if self.token_ids is not None:
            tensors["token_ids"] = self.token_ids
        if self.embeds is not None:
            tensors["embeds"] = self.embeds
        meta = {
            "kind": "chunk",
            "id": self.id,
            "fingerprint": self.fingerprint,
            "layout": self.layout_signature,
            "root_digest": self.root_digest,
            "span": str(self.span),
            "canonical_start": str(self.canonical_start),
            "modality": self.modality,
            "content_digest": self.id,
            "extra": json.dumps(self.meta, sort_keys=True),
        }
        return tensors, meta

    @classmethod
    def from_entry(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> "Chunk":
        try:
            if meta.get("kind") != "chunk":
                raise KeyError("kind")
            return cls(
                id=meta["id"],
                fingerprint=meta["fingerprint"],
                layout_signature=meta["layout"],
                root_digest=meta["root_digest"],
                keys=tensors["keys"],
                values=tensors["values"],
                rel_positions=tensors["rel_positions"],
                span=int(meta["span"]),
                canonical_start=int(meta["canonical_start"]),
                token_ids=tensors.get("token_ids"),
                embeds=tensors.get("embeds"),
                modality=meta.get("modality", "text"),
                meta=json.loads(meta.get("extra", "{}")),
            )
        except (KeyError, ValueError) as exc:
            raise CorruptEntryError(f"stored chunk entry is malformed: {exc}") from exc


def format_bytes(n: int) -> str:
    """``n`` bytes for a human (B, KiB, MiB)."""
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 1024**2 else f"{n / 1024**2:.1f} MiB"


def chunk_id(fingerprint: str, root_digest: str, input_digest: str, dtype: torch.dtype) -> str:
    """Content address of a chunk: model, root, inputs and storage dtype."""
    return digest(fingerprint, root_digest, input_digest, str(dtype))[:32]
