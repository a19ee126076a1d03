"""Images on a model: reading and checking pixels, the image path a model has (the real vision
tower of a Qwen-VL model, or the documented emulation on a text-only model), and the one image-span
emulation that the agents, the chat sessions and the evaluation (``verify``, the probe set) share.

The emulation (text-only models such as the default SmolLM2): real pixels are cut into 16x16
patches and sent through a fixed seeded random projection into the model's input-embedding
space (:func:`pixel_span_embeddings`). It exercises everything the window
does with an image span (its size, its position, storing, relocating, patching, recalling it)
but the model has NO visual understanding of it: answers about the picture's content are not
meaningful on such a model.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.chunk import digest
from ..core.errors import MediaError, MediaTypeError, UnsupportedMediaError

SUPPORTED_IMAGE_MODES = ("RGB", "L")
"""PIL modes an image may come in (``L``, grayscale, becomes three equal channels)."""

DEFAULT_IMAGE_TOKENS = 64
"""Most tokens an emulated image span takes (its grid keeps the picture's aspect)."""

PATCH_PX = 16  # image-span patch size in pixels
PROJECTION_SEED = 20240611  # fixed: the emulated "vision tower" never changes between runs


# ---------------------------------------------------------------------------- images


def load_image(image: Any, *, name: str = "image") -> np.ndarray:
    """Pixels ``[H, W, 3]`` uint8 from an array, a PIL image, encoded bytes, a file path or a
    ``data:image/...;base64,`` URL.

    Arrays: ``[H, W]`` (grayscale) or ``[H, W, 3]``, uint8 or floats in [0, 1]. PIL images in
    mode RGB or L.

    Raises:
        MediaTypeError: ``image`` is none of those types.
        UnsupportedMediaError: a mode or channel count other than RGB / grayscale (e.g. RGBA, CMYK).
        MediaError: the bytes or file cannot be decoded, or the picture is empty.
    """
    if isinstance(image, (str, Path)):
        text = str(image)
        if text.startswith("data:"):
            return load_image(_data_url_bytes(text, name), name=name)
        if text.startswith(("http://", "https://")):
            raise MediaError(f"{name}: remote image URLs are not fetched; pass the pixels or a data: URL")
        try:
            data = Path(text).read_bytes()
        except OSError as exc:
            raise MediaError(f"{name}: cannot read {text!r}: {exc.strerror or exc}") from exc
        return load_image(data, name=name)
    if isinstance(image, (bytes, bytearray, memoryview)):
        from PIL import Image, UnidentifiedImageError

        try:
            pil = Image.open(io.BytesIO(bytes(image)))
            pil.load()
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise MediaError(f"{name}: not a readable image ({exc})") from exc
        return load_image(pil, name=name)
    if _is_pil(image):
        if image.mode not in SUPPORTED_IMAGE_MODES:
            raise UnsupportedMediaError(
                f"{name}: image mode {image.mode!r} is not supported; convert it to one of "
                f"{SUPPORTED_IMAGE_MODES} first (e.g. image.convert('RGB'))"
            )
        return load_image(np.asarray(image), name=name)
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    if not isinstance(image, np.ndarray):
        raise MediaTypeError(
            f"{name} must be an array, a PIL image, bytes, a path or a data: URL, got {type(image).__name__}"
        )
    a = image
    if a.ndim == 3 and a.shape[-1] == 1:
        a = a[..., 0]
    if a.ndim == 2:
        a = np.stack([a] * 3, axis=-1)
    if a.ndim != 3 or a.shape[-1] != 3:
        mode = {2: "LA", 4: "RGBA"}.get(a.shape[-1] if a.ndim == 3 else -1, f"shape {tuple(image.shape)}")
        raise UnsupportedMediaError(f"{name}: {mode} pixels are not supported; give [H, W] or [H, W, 3] (RGB)")
    if a.shape[0] < 1 or a.shape[1] < 1:
        raise MediaError(f"{name}: empty picture {tuple(a.shape)}")
    if a.dtype == np.uint8:
        return np.ascontiguousarray(a)
    if a.dtype == bool:
        return np.ascontiguousarray(a.astype(np.uint8) * 255)
    if a.dtype.kind == "f":
        if not np.isfinite(a).all() or a.min() < 0.0 or a.max() > 1.0:
            raise UnsupportedMediaError(f"{name}: float pixels must be finite and in [0, 1]")
        return np.ascontiguousarray(np.round(a * 255.0).astype(np.uint8))
    raise UnsupportedMediaError(f"{name}: pixel dtype {a.dtype} is not supported (uint8 or floats in [0, 1])")


def _is_pil(x: Any) -> bool:
    from PIL import Image

    return isinstance(x, Image.Image)


def _data_url_bytes(url: str, name: str) -> bytes:
    head, _, payload = url.partition(",")
    if not head.startswith("data:image/") or ";base64" not in head:
        raise MediaError(f"{name}: only base64 data:image/... URLs are read, got {head[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"{name}: the data URL's base64 payload is malformed") from exc


def pixel_digest(pixels: np.ndarray) -> str:
    """Content digest of pixels (what makes two images the same chunk)."""
    return digest(torch.from_numpy(np.array(pixels, copy=True)))[:24]


def emulation_grid(height: int, width: int, max_tokens: int = DEFAULT_IMAGE_TOKENS) -> tuple[int, int]:
    """``(rows, cols)`` of an emulated span: the picture's aspect, ``rows * cols <= max_tokens``."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    aspect = height / max(1, width)
    rows = max(1, int(math.floor(math.sqrt(max_tokens * aspect))))
    cols = max(1, min(max_tokens // rows, int(round(rows / aspect)) or 1))
    return rows, cols


@dataclass
class ImagePath:
    """How a backend turns pixels into an image chunk.

    ``kind``: ``"vision"`` (a Qwen-VL model's own vision tower and processor, through
    ``ContextWindow.append(image=, processor=)``: the window's store keeps the tower's output,
    so a pixel array is encoded once) or ``"emulated"`` (text-only models: a fixed seeded
    projection, no visual understanding). ``projections``: emulated spans computed so far
    (the emulation's stand-in for tower runs).
    """

    backend: Any
    processor: Any = None
    max_tokens: int = DEFAULT_IMAGE_TOKENS
    projections: int = 0

    @property
    def kind(self) -> str:
        return "vision" if self.processor is not None else "emulated"

    def __post_init__(self) -> None:
        mt = getattr(self.backend.model.config, "model_type", "")
        if self.processor is None and mt in ("qwen2_vl", "qwen2_5_vl"):
            raise MediaError(f"a {mt} model takes images through its vision tower: pass its image processor")

    def append_kwargs(self, pixels: np.ndarray) -> dict[str, Any]:
        """Keyword arguments for ``ContextWindow.append`` that place ``pixels`` as an image chunk."""
        if self.processor is not None:
            return {"image": pixels, "processor": self.processor}
        rows, cols = emulation_grid(pixels.shape[0], pixels.shape[1], self.max_tokens)
        hidden = int(self.backend.model.get_input_embeddings().weight.shape[1])
        px = resize_to_grid(pixels.astype(np.float64) / 255.0, (rows, cols))
        emb = pixel_span_embeddings(px, (rows, cols), hidden, embedding_norm(self.backend))
        self.projections += 1
        return {"embeds": emb.to(self.backend.dtype), "modality": "image-emulated"}

    def tower_calls(self, window: Any) -> int:
        """Times pixels were turned into embeddings: the vision tower's runs (counted by the
        window) or the emulation's projections."""
        if self.processor is not None:
            return window.context.counters.vision_encodes
        return self.projections


# ---------------------------------------------------------------------------- the emulation


def _as_rgb(img: np.ndarray) -> np.ndarray:
    a = np.asarray(img)
    if a.dtype == bool:
        a = a.astype(np.float64)
    elif a.dtype.kind in "ui":
        a = a.astype(np.float64) / float(np.iinfo(a.dtype).max)
    else:
        a = a.astype(np.float64)
    if a.ndim == 2:
        a = np.stack([a] * 3, axis=-1)
    return a[..., :3]


def image_pixels(name: str, grid: tuple[int, int]) -> np.ndarray:
    """``skimage.data.<name>()`` as RGB floats in [0, 1], resized to ``grid * PATCH_PX`` pixels."""
    import skimage.data  # a base dependency, imported here because it is slow to import

    return resize_to_grid(getattr(skimage.data, name)(), grid)


def embedding_norm(backend: Any) -> float:
    """Mean L2 norm of the LM's input-embedding rows (the scale image spans are brought to)."""
    w = backend.model.get_input_embeddings().weight.detach().to(torch.float32)
    return float(w.norm(dim=-1).mean())


def image_span_embeddings(name: str, grid: tuple[int, int], hidden: int, target_norm: float) -> torch.Tensor:
    """EMULATED image span ``[rows * cols, hidden]`` of ``skimage.data.<name>()`` (see
    :func:`pixel_span_embeddings`)."""
    return pixel_span_embeddings(image_pixels(name, grid), grid, hidden, target_norm)


def resize_to_grid(pixels: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """RGB pixels ``[H, W, 3]`` (floats in [0, 1]) resized to ``grid * PATCH_PX`` pixels."""
    from skimage.transform import resize

    rows, cols = grid
    return resize(_as_rgb(pixels), (rows * PATCH_PX, cols * PATCH_PX), order=1, anti_aliasing=True, preserve_range=True)


def pixel_span_embeddings(px: np.ndarray, grid: tuple[int, int], hidden: int, target_norm: float) -> torch.Tensor:
    """EMULATED image span ``[rows * cols, hidden]`` from pixels ``[rows*16, cols*16, 3]`` in [0, 1]:
    16x16-px RGB patches (row-major), centred, through a fixed seeded Gaussian projection plus a
    fixed seeded offset, each row scaled to ``target_norm``. No vision model: a stand-in with the
    statistics of real pixels, for models without a vision tower."""
    rows, cols = grid
    p = PATCH_PX
    patches = px.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, p * p * 3)
    x = torch.from_numpy(patches - 0.5).to(torch.float32)
    g = torch.Generator().manual_seed(PROJECTION_SEED + hidden)
    proj = torch.randn(p * p * 3, hidden, generator=g) / (p * p * 3) ** 0.5
    offset = torch.randn(hidden, generator=g)
    y = x @ proj
    # the offset keeps flat patches (zero after centring) off the origin
    y = y + offset * y.norm(dim=-1).median().clamp_min(1e-3) / offset.norm()
    return y / y.norm(dim=-1, keepdim=True).clamp_min(1e-6) * target_norm
