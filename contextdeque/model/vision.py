"""Image chunks through a Qwen-VL model's own vision tower and position logic.

The vision tower runs once per image; the chunk keeps its output embeddings so a recall never
re-runs it. The chunk's t/h/w position grid and how far it advances the next text position
(its span) come from the installed model's ``get_rope_index``, never from the token count: the
rule differs between transformers versions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..core.chunk import Chunk, digest
from ..core.errors import CorruptEntryError, UnsupportedLayoutError
from .hf import HFBackend

VL_MODEL_TYPES = {"qwen2_vl", "qwen2_5_vl"}


def _vl_core(backend: HFBackend) -> torch.nn.Module:
    mt = getattr(backend.model.config, "model_type", "")
    if mt == "qwen3_vl":
        raise UnsupportedLayoutError(
            "qwen3_vl injects visual features into several decoder layers (deepstack), which an "
            "input-embedding chunk cannot carry; encode its text, or image spans as embeddings"
        )
    if mt not in VL_MODEL_TYPES:
        raise UnsupportedLayoutError(f"{mt!r} has no supported vision path; supported: {sorted(VL_MODEL_TYPES)}")
    return backend.model.model


def image_token_id(backend: HFBackend) -> int:
    return int(backend.model.config.image_token_id)


@torch.no_grad()
def image_inputs(backend: HFBackend, image: Any, processor: Any) -> dict[str, torch.Tensor]:
    """Processor outputs for one image: ``pixel_values [P, C·t·p·p]``, ``image_grid_thw [1, 3]``."""
    if isinstance(image, np.ndarray) and image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    out = processor(images=[image], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


@torch.no_grad()
def image_grid_positions(backend: HFBackend, grid_thw: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, int]:
    """``(rel_positions [3, n_tokens], span)`` of one image placed at position 0, asked of the model's
    own ``get_rope_index`` with one text token after the image to read the span."""
    core = _vl_core(backend)
    ids = torch.full((1, n_tokens + 1), image_token_id(backend), dtype=torch.long)
    ids[0, -1] = backend.root_ids[0]
    mm = torch.zeros_like(ids, dtype=torch.int)
    mm[0, :n_tokens] = 1
    pos, _ = core.get_rope_index(ids, mm, image_grid_thw=grid_thw)
    pos = pos[-3:, 0]  # [3, n+1] (some versions prepend a text-position row)
    return pos[:, :n_tokens].clone(), int(pos[0, n_tokens])


@dataclass
class ImageEmbedding:
    """A vision tower's output for one image, ready to encode as a chunk: ``embeds [T, hidden]``,
    ``rel_positions [3, T]`` and ``span`` from the model's own rope index, and ``pixel_key`` (a
    digest of the pixels and the processor settings) that addresses it in a store."""

    embeds: torch.Tensor
    rel_positions: torch.Tensor
    span: int
    pixel_key: str

    def to_entry(self, fingerprint: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors = {"embeds": self.embeds, "rel_positions": self.rel_positions}
        meta = {"kind": "embeds", "fingerprint": fingerprint, "span": str(self.span), "pixel_key": self.pixel_key,
                "content_digest": self.pixel_key}
        return tensors, meta

    @classmethod
    def from_entry(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> "ImageEmbedding":
        try:
            return cls(tensors["embeds"], tensors["rel_positions"], int(meta["span"]), meta["pixel_key"])
        except (KeyError, ValueError) as exc:
            raise CorruptEntryError(f"stored image embedding is malformed: {exc}") from exc


def pixel_key(image: Any, processor: Any) -> str:
    """Digest of the raw pixels and the processor settings (what decides the tower's output)."""
    arr = np.ascontiguousarray(np.asarray(image))
    settings = processor.to_dict() if hasattr(processor, "to_dict") else repr(processor)
    return digest(torch.from_numpy(arr.copy()), json.dumps(settings, sort_keys=True, default=str))[:32]


@torch.no_grad()
def image_embedding(backend: HFBackend, image: Any, processor: Any) -> ImageEmbedding:
    """Run the processor and the vision tower once for ``image`` (HxWx3 array or PIL image)."""
    core = _vl_core(backend)
    inputs = image_inputs(backend, image, processor)
    feats = core.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    feats = getattr(feats, "pooler_output", feats)
    emb = feats[0] if isinstance(feats, (list, tuple)) else feats
    rel, span = image_grid_positions(backend, inputs["image_grid_thw"], emb.shape[0])
    return ImageEmbedding(emb.detach().cpu().clone(), rel, span, pixel_key(image, processor))


def encode_image(
    backend: HFBackend, image: Any, processor: Any, *, storage: torch.dtype | str = torch.float32
) -> Chunk:
    """Encode an image as a canonical chunk: the vision tower runs once; the chunk keeps its
    embeddings ``[n_tokens, hidden]``, its model position grid and span, and the pixel key in ``meta``."""
    img = image_embedding(backend, image, processor)
    return backend.encode(
        embeds=img.embeds, rel_positions=img.rel_positions, span=img.span, storage=storage, modality="image",
        meta={"pixel_digest": img.pixel_key},
    )
