"""``contextdeque verify-model``: the per-model exactness gate (the oracle itself,
:func:`contextdeque.model.detect.check_chunk`, is the one the proof at load runs on a shorter chunk).

Encodes real text (and, for M-RoPE models, an image-span emulation with a genuine t/h/w grid),
relocates it to several offsets (one ≥ 4,000 positions away) and compares, layer by layer, with
transformers' own forward of the same tokens with every position shifted by the same offset.

Errors are relative to each tensor's scale (max |x|). The model's forward is itself not
noise-free far from position 0 (fp32 RoPE angles drift by about p·6e-8 rad, which also moves the
values RoPE never touches), so the gate measures that noise floor — the non-rotated channels'
difference between the forward at the canonical positions and at the target — beside the
rotated channels' relocation error. Pass: fp32 storage, key error ≤ max(2 × noise floor, 1e-5)
at every offset; bf16 storage, key error ≤ one bf16 ULP of the tensor's scale, i.e. the spacing of bf16 numbers
at max |x| (between 2^-8 and 2^-7 of it): storing in bf16 costs half an ULP per element, and a
rotation mixes two elements of a pair, so up to √2 half-ULPs before the model's own noise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ..model.hf import HFBackend
from ..core.chunk import Chunk
from ..core.metrics import ulp
from ..model.detect import OffsetReport, check_chunk
from ..model.images import embedding_norm, image_span_embeddings
from ..model.text import tokenize

DEFAULT_OFFSETS = (1, 37, 999, 4099)


@dataclass
class VerifyReport:
    model: str
    layout: str
    layers: int
    offsets: list[int]
    max_rel_err: float = 0.0
    noise_floor: float = 0.0
    max_ulp_bf16: float = 0.0
    ok: bool = True
    refused: list[str] = field(default_factory=list)
    details: list[OffsetReport] = field(default_factory=list)

    def to_json(self) -> dict:
        d = asdict(self)
        return d


def bf16_ulp(scale: float) -> float:
    """Spacing of bfloat16 numbers at ``scale`` (8 significand bits): 2^(floor(log2 scale) - 7)."""
    return float(ulp(torch.tensor([scale]), torch.bfloat16)[0])


def real_text_ids(backend: HFBackend, n_tokens: int) -> torch.Tensor:
    """``[n_tokens]`` ids of real English (CPython's pydoc topics). Without a tokenizer (random tiny
    models) the UTF-8 bytes are folded into the vocabulary (see :func:`contextdeque.model.text.tokenize`)."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in ("lambda", "if", "while", "for", "try", "with"))
    return torch.tensor(tokenize(backend, text)[:n_tokens], dtype=torch.long)


def image_span_chunk(backend: HFBackend, grid: tuple[int, int] = (4, 6), image: str = "astronaut") -> Chunk:
    """An image-span chunk with a genuine M-RoPE grid: t fixed, h and w walking the grid, next
    position = start + max(h, w) extent (the Qwen2-VL rule). Embeddings are the project's one
    image-span emulation (:func:`contextdeque.model.images.image_span_embeddings`: real pixels through a
    fixed seeded projection), no vision tower involved."""
    h, w = grid
    hidden = int(backend.model.get_input_embeddings().weight.shape[1])
    emb = image_span_embeddings(image, grid, hidden, embedding_norm(backend)).to(backend.dtype)
    t_ax = torch.zeros(h * w, dtype=torch.long)
    h_ax = torch.arange(h).repeat_interleave(w)
    w_ax = torch.arange(w).repeat(h)
    rel = torch.stack([t_ax, h_ax, w_ax])
    return backend.encode(embeds=emb, rel_positions=rel, span=max(h, w), modality="image")


def verify_backend(backend: HFBackend, offsets: list[int] | None = None, n_tokens: int = 96, name: str | None = None) -> VerifyReport:
    layout = backend.layout
    offsets = list(offsets or DEFAULT_OFFSETS)
    report = VerifyReport(model=name or backend.name, layout=layout.describe(), layers=layout.num_layers, offsets=offsets)
    chunks = [("text", backend.encode(token_ids=real_text_ids(backend, n_tokens)))]
    if layout.n_pos_axes > 1:
        chunks.append(("image-span", image_span_chunk(backend)))
    usable = offsets
    if layout.max_exact_position is not None:
        limit = layout.max_exact_position - backend.root_len - n_tokens
        usable = [o for o in offsets if o < limit]
        report.refused = [f"offset {o}: past the {layout.rope_type} switch point" for o in offsets if o >= limit]
    for label, chunk in chunks:
        report.details.extend(check_chunk(backend, chunk, usable, label))
    if report.details:
        report.max_rel_err = max(d.key_rel_err for d in report.details)
        report.noise_floor = max(d.noise_floor for d in report.details)
        report.max_ulp_bf16 = max(d.bf16_ulp for d in report.details)
        report.ok = all(d.ok for d in report.details)
    else:
        report.ok = False
    return report
