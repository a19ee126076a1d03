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
from ..model.detect import FP32_FLOOR, OffsetReport, check_chunk  # noqa: F401  (FP32_FLOOR re-exported)

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
    models) the UTF-8 bytes are folded into the vocabulary."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in ("lambda", "if", "while", "for", "try", "with"))
    if backend.tokenizer is not None:
        ids = backend.tokenize(text)[:n_tokens]
    else:
        vocab = backend.model.get_input_embeddings().weight.shape[0]
        ids = [4 + (b % (vocab - 4)) for b in text.encode()[:n_tokens]]
    return torch.tensor(ids, dtype=torch.long)


def image_span_chunk(backend: HFBackend, grid: tuple[int, int] = (4, 6), seed: int = 0) -> Chunk:
    """An image-span chunk with a genuine M-RoPE grid: t fixed, h and w walking the grid, next
    position = start + max(h, w) extent (the Qwen2-VL rule). Embeddings come from real pixels
    (scikit-image) through a fixed seeded projection — an emulation, no vision tower involved."""
    h, w = grid
    emb = pixel_embeddings(backend, h * w, seed)
    t_ax = torch.zeros(h * w, dtype=torch.long)
    h_ax = torch.arange(h).repeat_interleave(w)
    w_ax = torch.arange(w).repeat(h)
    rel = torch.stack([t_ax, h_ax, w_ax])
    return backend.encode(embeds=emb, rel_positions=rel, span=max(h, w), modality="image")


def pixel_embeddings(backend: HFBackend, n_tokens: int, seed: int = 0) -> torch.Tensor:
    """``[n_tokens, hidden]`` embeddings from a real photo's patches via a seeded random projection,
    scaled to the model's token-embedding norm (an emulation of a vision tower's output)."""
    import numpy as np
    from skimage import data

    img = data.astronaut().astype(np.float32) / 255.0  # [512, 512, 3]
    side = int(np.ceil(np.sqrt(n_tokens)))
    ps = img.shape[0] // side
    patches = [
        img[i * ps : (i + 1) * ps, j * ps : (j + 1) * ps].reshape(-1) for i in range(side) for j in range(side)
    ][:n_tokens]
    x = torch.tensor(np.stack(patches))
    x = x - x.mean(dim=1, keepdim=True)
    emb_w = backend.model.get_input_embeddings().weight.detach()
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(x.shape[1], emb_w.shape[1], generator=g) / x.shape[1] ** 0.5
    e = x @ proj
    e = e / e.norm(dim=1, keepdim=True).clamp_min(1e-6) * emb_w.norm(dim=1).mean()
    return e.to(emb_w.dtype)


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
