"""Video for the agents: decoding a video file with PyAV and building a clip from real
photographs. Images (reading pixels, the image path a model has, the emulation) live one layer
down in :mod:`contextdeque.model.images`; their names are re-exported here for the agents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from contextdeque.core.errors import MediaError
from contextdeque.model.images import (
    DEFAULT_IMAGE_TOKENS,
    SUPPORTED_IMAGE_MODES,
    ImagePath,
    emulation_grid,
    load_image,
    pixel_digest,
)

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
