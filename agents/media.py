"""Images and video for the agents: reading and checking pixels, the image path a model has (the
real vision tower of a Qwen-VL model, or the documented emulation on a text-only model), decoding
a video file with PyAV, and building a clip from real photographs.

The emulation (text-only models such as the default SmolLM2): real pixels are cut into 16x16
patches and sent through a fixed seeded random projection into the model's input-embedding
space (``contextdeque.eval.fidelity.probes.pixel_span_embeddings``). It exercises everything the window
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
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from contextdeque.core.errors import MediaError, MediaTypeError, UnsupportedMediaError

SUPPORTED_IMAGE_MODES = ("RGB", "L")
"""PIL modes an image may come in (``L``, grayscale, becomes three equal channels)."""

DEFAULT_IMAGE_TOKENS = 64
"""Most tokens an emulated image span takes (its grid keeps the picture's aspect)."""


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
    from contextdeque.core.chunk import digest

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
        from contextdeque.eval.fidelity.probes import embedding_norm, pixel_span_embeddings, resize_to_grid

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
            return int(window.context.counters.get("vision_encodes", 0))
        return self.projections


# ---------------------------------------------------------------------------- video


def decode_video(path: str | Path, *, every: int = 1, max_frames: int | None = None) -> list[np.ndarray]:
    """Frames ``[H, W, 3]`` uint8 of a video file, decoded with PyAV (FFmpeg): every ``every``-th
    frame, at most ``max_frames``.

    Raises:
        MediaError: the file is missing, not a video, or has no video stream / no frames.
    """
    import av  # imported here: PyAV pulls in FFmpeg, which text-only callers never need

    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    frames: list[np.ndarray] = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise MediaError(f"{path}: no video stream")
            for i, frame in enumerate(container.decode(video=0)):
                if i % every:
                    continue
                frames.append(frame.to_ndarray(format="rgb24"))
                if max_frames is not None and len(frames) >= max_frames:
                    break
    except MediaError:
        raise
    except (av.FFmpegError, OSError) as exc:
        raise MediaError(f"{path}: not a readable video ({exc})") from exc
    if not frames:
        raise MediaError(f"{path}: the video has no frames")
    return frames


CLIP_IMAGES = ("astronaut", "coffee", "chelsea", "rocket")
"""scikit-image's bundled photographs the default clip is made of, one shot each."""


def _shot(img: np.ndarray, n: int, size: tuple[int, int], move: str) -> Iterator[np.ndarray]:
    """``n`` frames of ``size`` (w, h) moving over ``img``: ``pan`` (left to right), ``zoom`` (in
    towards the centre) or ``crop`` (a fixed crop drifting down)."""
    from skimage.transform import resize

    H, W = img.shape[:2]
    w, h = size
    for i in range(n):
        t = i / max(1, n - 1)
        if move == "pan":
            ch, cw = H, min(W, int(H * w / h))
            y0, x0 = 0, int(t * (W - cw))
        elif move == "zoom":
            s = 1.0 - 0.5 * t
            ch, cw = int(H * s), int(min(W, H * w / h) * s)
            y0, x0 = (H - ch) // 2, (W - cw) // 2
        else:
            ch, cw = H // 2, min(W // 2, int(H // 2 * w / h))
            y0, x0 = int(t * (H - ch)), (W - cw) // 2
        crop = img[y0 : y0 + ch, x0 : x0 + cw]
        out = resize(crop, (h, w), order=1, anti_aliasing=True, preserve_range=True)
        yield np.clip(out, 0, 255).astype(np.uint8)


def build_clip(
    path: str | Path,
    *,
    images: Sequence[str] = CLIP_IMAGES,
    frames_per_shot: int = 8,
    size: tuple[int, int] = (128, 96),
    fps: int = 8,
) -> Path:
    """Write an MPEG-4 clip made of real photographs (``skimage.data``): one shot per image, each
    a pan, a zoom or a drifting crop over it. Returns the path."""
    import av
    import skimage.data

    moves = ("pan", "zoom", "crop")
    path = Path(path)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.bit_rate = 2_000_000
        for j, name in enumerate(images):
            img = load_image(getattr(skimage.data, name)(), name=name)
            for frame in _shot(img, frames_per_shot, size, moves[j % len(moves)]):
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


__all__ = [
    "SUPPORTED_IMAGE_MODES",
    "DEFAULT_IMAGE_TOKENS",
    "load_image",
    "pixel_digest",
    "emulation_grid",
    "ImagePath",
    "decode_video",
    "build_clip",
    "CLIP_IMAGES",
]
