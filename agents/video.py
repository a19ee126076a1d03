"""VideoAgent: watches a video segment by segment through a window that holds a few segments,
answers a sequence of prompts, looks back at earlier segments and puts two segments side by side
to compare them.

The video is a real file decoded with PyAV (``agents.media.decode_video``); with no file given, a
clip is built from real photographs (``skimage.data``: a pan, a zoom and a drifting crop over
each, ``agents.media.build_clip``) and decoded back. A list of frames (arrays, PIL images, encoded
bytes, paths) is taken as given. Frames are cut into segments of ``frames_per_segment``.

Each frame is an image chunk, through the image path the model has (``agents.media.ImagePath``):

- a Qwen2-VL / Qwen2.5-VL model with its image processor (``processor=``): the model's own
  vision tower, its M-RoPE position grid, each frame wrapped in the model's vision start / end
  tokens (so the window holds exactly what the model's own forward over the same frames would);
  the store keeps the tower's output, so a frame seen before never runs the tower again;
- a text-only model (the default SmolLM2): the documented image-span emulation (real pixels → a
  fixed seeded projection → input embeddings). It exercises everything the window does with a
  frame, but **the model has no visual understanding of it**: its answers about what a segment
  shows mean nothing on such a model.

The script (seeded; the scripted parts are navigation, **the model answers** every prompt and
makes the yes/no comparison):

1. **watch** segment ``s``: its header and frames are appended (encoded once, ever); the oldest
   segments step out (evicted whole, recallable) so that at most ``segments_in_window`` are in
   the window beside the instruction; the model is asked what the segment shows. The segment's
   frames arrive before its step: it is read ahead in that wait (``AgentRun.read_ahead``: the
   frames' canonicals and the patches they get where they land), so the step runs only the
   question's forward (text-only models; a VL model's frames go through its tower in the step);
2. every ``lookback_every`` segments, once earlier segments have left: **look back** at one of
   them (chosen by the seed): its chunks are ``recall``-ed (canonical + a fresh patch on what now
   precedes them; neither re-encoded nor sent through the vision tower again — counted in
   ``tower_calls``) and the model is asked about it. The agent names the chunks it will recall
   (``window.expect``) and the seek back is its idle time (``AgentRun.idle``): the window
   prepares those recalls then, off the step's clock, so the look-back runs no forward on the
   critical path;
3. **compare**: the window is ``reorder``-ed so the looked-back segment sits right before the
   current one (chronological order), and the model says whether the two show the same scene.
   The agent names that order before the step (``window.expect_order``): the idle time before
   it prepares the reorder's patches.

Bad input — a missing or unreadable video (``MediaError``), an unreadable frame
(``MediaError`` / ``MediaTypeError``), a frame in an unsupported mode (``UnsupportedMediaError``),
a segment larger than the window (``BudgetError``) — is refused before the window is touched.
"""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from contextdeque.core.errors import AgentInputError, BudgetError, MediaError, MediaTypeError
from contextdeque.window import DEFAULT_RANK

from .base import AgentConfig, AgentRun, Step, chunk_hash
from .media import ImagePath, build_clip, decode_video, emulation_grid, load_image, pixel_digest

INSTRUCTION = (
    "You are watching a video, segment by segment. Each segment is a few frames. "
    "Answer questions about the segments briefly.\n\n"
)


@dataclass(frozen=True)
class Segment:
    """Frames ``first``..``first + len(frames) - 1`` of the video (index ``index``, from 1)."""

    index: int
    first: int
    frames: tuple[np.ndarray, ...]
    frame_tokens: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"seg{self.index}"

    @property
    def last(self) -> int:
        return self.first + len(self.frames) - 1


def load_frames(video: Any, *, every: int = 1, max_frames: int | None = None) -> list[np.ndarray]:
    """Frames ``[H, W, 3]`` uint8: ``video`` is a path to a video file (decoded with PyAV, every
    ``every``-th frame), ``None`` (a clip built from ``skimage.data`` photographs, decoded back),
    or a sequence of frames (arrays, PIL images, bytes, paths, or one ``[N, H, W, C]`` array;
    each checked by ``load_image``).

    Raises:
        MediaError: an unreadable video or frame; MediaTypeError: a frame of an unknown type;
        UnsupportedMediaError: a frame in a mode other than RGB / grayscale.
    """
    if every < 1:
        raise AgentInputError(f"every must be >= 1, got {every}")
    if video is None:
        with tempfile.TemporaryDirectory(prefix="contextdeque-clip-") as d:
            return decode_video(build_clip(Path(d) / "clip.mp4"), every=every, max_frames=max_frames)
    if isinstance(video, (str, Path)):
        return decode_video(video, every=every, max_frames=max_frames)
    if isinstance(video, np.ndarray) and video.ndim == 4:  # [N, H, W, C] frames
        video = list(video)
    if isinstance(video, Sequence) and not isinstance(video, (bytes, bytearray)):
        frames = [load_image(f, name=f"frame {i}") for i, f in enumerate(video)][::every]
        return frames[:max_frames] if max_frames is not None else frames
    raise MediaTypeError(f"video must be a path, None or a sequence of frames, got {type(video).__name__}")


class VideoAgent:
    """Watches a video through a window of a few segments (see the module).

    Args:
        backend: an ``HFBackend`` with a tokenizer (a Qwen-VL model needs ``processor``).
        config: window and measurement settings (:class:`AgentConfig`).
        processor: the VL model's image processor (frames through its vision tower); ``None`` on
            a text-only model (the image-span emulation).
        frames_per_segment: frames in a segment.
        segments_in_window: most segments in the window at once (a look-back may add one).
        lookback_every: look back (and compare) after every this many segments; 0: never.
        image_tokens: most tokens an emulated frame takes (text-only models).
        on_step: called with every finished step (live display).
    """

    kind = "video"
    default_rank = DEFAULT_RANK  # (its config's rank=None)

    def __init__(self, backend: Any, config: AgentConfig | None = None, *, processor: Any = None,
                 frames_per_segment: int = 3, segments_in_window: int = 2, lookback_every: int = 2,
                 image_tokens: int = 36, on_step: Callable[[Step], None] | None = None) -> None:
        if frames_per_segment < 1 or segments_in_window < 1 or lookback_every < 0:
            raise AgentInputError("frames_per_segment and segments_in_window must be >= 1, lookback_every >= 0")
        self.backend = backend
        self.config = (config or AgentConfig()).with_default_rank(self.default_rank)
        self.images = ImagePath(backend, processor=processor, max_tokens=image_tokens)
        self.frames_per_segment = int(frames_per_segment)
        self.segments_in_window = int(segments_in_window)
        self.lookback_every = int(lookback_every)
        self.on_step = on_step
        self.segments: list[Segment] = []
        self.run: AgentRun | None = None
        self.tower_log: list[tuple[int, str, int]] = []  # (step index, op, tower runs during the step)
        self._resident: list[int] = []  # segment indices in the window, in window order
        self._instruction = list(backend.tokenize(INSTRUCTION))
        if processor is not None:
            cfg = backend.model.config
            self._wrap: tuple[list[int], list[int]] = ([int(cfg.vision_start_token_id)], [int(cfg.vision_end_token_id)])
        else:
            self._wrap = ([], [])

    # ------------------------------------------------------------------ sizes
    def frame_tokens(self, pixels: np.ndarray) -> int:
        """Tokens ``pixels`` take as an image chunk (asked of the processor, or the emulation grid)."""
        proc = self.images.processor
        if proc is None:
            r, c = emulation_grid(pixels.shape[0], pixels.shape[1], self.images.max_tokens)
            return r * c
        grid = proc(images=[pixels], return_tensors="pt")["image_grid_thw"][0]
        return int(grid.prod()) // int(getattr(proc, "merge_size", 2)) ** 2

    def _header_ids(self, seg: Segment) -> list[int]:
        return list(self.backend.tokenize(f"[segment {seg.index}: frames {seg.first + 1}-{seg.last + 1}]\n"))

    def segment_pieces(self, seg: Segment) -> list[tuple[str, dict[str, Any], str, str]]:
        """``(label, append kwargs, modality, content key)`` of a segment's chunks, in order:
        its header, then each frame (wrapped in the VL model's vision start / end tokens)."""
        start, end = self._wrap
        pieces: list[tuple[str, dict[str, Any], str, str]] = []
        head = self._header_ids(seg) + start
        pieces.append((seg.label, {"token_ids": head}, "text", chunk_hash(tuple(head))))
        for k, px in enumerate(seg.frames):
            pieces.append((f"{seg.label}/f{k + 1}", {"_pixels": px}, "frame", pixel_digest(px)))
            sep = end + (start if k + 1 < len(seg.frames) else list(self.backend.tokenize("\n")))
            if end:
                pieces.append((f"{seg.label}/s{k + 1}", {"token_ids": sep}, "text", chunk_hash(tuple(sep))))
        return pieces

    def segment_tokens(self, seg: Segment) -> int:
        start, end = self._wrap
        n = len(self._header_ids(seg)) + len(start) + sum(seg.frame_tokens)
        if end:
            n += len(seg.frames) * len(end) + (len(seg.frames) - 1) * len(start) + len(self.backend.tokenize("\n"))
        return n

    def load(self, video: Any = None, *, every: int = 1, max_frames: int | None = None) -> list[Segment]:
        """Decode and check ``video`` (see :func:`load_frames`), cut it into segments and size
        them, without touching any window.

        Raises:
            BudgetError: the instruction and one segment (two, when the agent compares) do not
                fit the window budget.
        """
        frames = load_frames(video, every=every, max_frames=max_frames)
        if not frames:
            raise MediaError("the video has no frames")
        segs = []
        for i in range(0, len(frames), self.frames_per_segment):
            fr = tuple(frames[i : i + self.frames_per_segment])
            segs.append(Segment(len(segs) + 1, i, fr, tuple(self.frame_tokens(f) for f in fr)))
        sizes = sorted((self.segment_tokens(s) for s in segs), reverse=True)
        need = len(self._instruction) + sum(sizes[: 2 if self.lookback_every and len(segs) > 1 else 1])
        if need > self.config.budget_tokens:
            raise BudgetError(
                f"a segment takes up to {sizes[0]} tokens: the instruction and "
                f"{'two segments (a comparison)' if self.lookback_every and len(segs) > 1 else 'one segment'} "
                f"need {need}, more than the window budget of {self.config.budget_tokens}; "
                "use fewer frames per segment, fewer image tokens or a larger budget"
            )
        return segs

    # ------------------------------------------------------------------ window operations
    def _tower(self) -> int:
        assert self.run is not None
        return self.images.tower_calls(self.run.window)

    def _end(self, run: AgentRun, st: Step, before: int) -> Step:
        calls = self._tower() - before
        if calls:
            st.notes.append(f"{'vision tower' if self.images.kind == 'vision' else 'pixel projection'} ran {calls}x")
        self.tower_log.append((st.index, st.op, calls))
        return run.end()

    def _leaving(self, need: int, keep: int, *, max_segments: int) -> list[int]:
        """The segments :meth:`_make_room` evicts, oldest in the window first (never ``keep``),
        until at most ``max_segments - 1`` remain and ``need`` more tokens fit."""
        run = self.run
        assert run is not None
        by_index = {s.index: s for s in self.segments}
        resident, used, out = list(self._resident), run.window.tokens_used, []
        while resident:
            if used + need <= self.config.budget_tokens and len(resident) < max_segments:
                break
            victims = [i for i in resident if i != keep]
            if not victims:
                break
            out.append(victims[0])
            resident.remove(victims[0])
            used -= sum(run.window.slot(run.ref_of[lab]).n_tokens for lab, *_ in self.segment_pieces(by_index[victims[0]]))
        return out

    def _make_room(self, leaving: Sequence[int], st: Step) -> None:
        """Evict the ``leaving`` segments whole (see :meth:`_leaving`)."""
        run = self.run
        assert run is not None
        by_index = {s.index: s for s in self.segments}
        for old in leaving:
            for label, *_ in self.segment_pieces(by_index[old]):
                run.evict(label)
            self._resident.remove(old)
            st.notes.append(f"segment {old} steps out")

    def _contents(self, seg: Segment) -> list[dict[str, Any]]:
        """``append`` arguments of each of a segment's chunks (a frame's pixels through the image
        path: once, whether read ahead or appended)."""
        return [self.images.append_kwargs(kw["_pixels"]) if "_pixels" in kw else kw for _, kw, _, _ in self.segment_pieces(seg)]

    def _show(self, seg: Segment, contents: Sequence[dict[str, Any]] | None = None) -> None:
        """Append a never-seen segment (``contents``: its chunks' ``append`` arguments, if made
        already), or recall one that left (never re-encoded)."""
        run = self.run
        assert run is not None
        pieces = self.segment_pieces(seg)
        for i, (label, kwargs, modality, key) in enumerate(pieces):
            if label in run.ref_of:
                run.recall(label)
                continue
            args = contents[i] if contents is not None else (
                self.images.append_kwargs(kwargs["_pixels"]) if "_pixels" in kwargs else kwargs)
            run.append(label, trace_modality=modality, content_key=key, **args)
        self._resident.append(seg.index)

    # ------------------------------------------------------------------ the script
    def watch(self, video: Any = None, *, every: int = 1, max_frames: int | None = None,
              segments: int | None = None, seed: int | None = None) -> AgentRun:
        """Watch ``video`` (see :meth:`load`; ``segments``: only the first N), answering a prompt
        per segment, with look-backs and comparisons (see the module). Returns the run.

        Raises:
            MediaError / MediaTypeError / UnsupportedMediaError / BudgetError: before the window
            is touched (``self.run`` stays ``None``).
        """
        segs = self.load(video, every=every, max_frames=max_frames)
        if segments is not None:
            segs = segs[: max(1, int(segments))]
        self.segments = segs
        rng = random.Random(self.config.seed if seed is None else seed)
        run = self.run = AgentRun(self.backend, self.config, generator="video", agent="VideoAgent", on_step=self.on_step)
        run.begin("instruction", f"{len(self._instruction)} tokens")
        run.append("instruction", token_ids=self._instruction, content_key=chunk_hash(INSTRUCTION))
        run.end()
        for seg in segs:
            self._show_and_ask("watch", f"segment {seg.index} ({len(seg.frames)} frames)", seg, seg.index,
                               f"What is shown in segment {seg.index}? Answer in one sentence.")
            gone = [s for s in segs[: seg.index - 1] if s.index not in self._resident]
            if self.lookback_every and seg.index % self.lookback_every == 0 and gone:
                self._look_back(rng.choice(gone), seg)
        return run

    def _show_and_ask(self, op: str, detail: str, seg: Segment, now: int, question: str) -> None:
        """One step that brings ``seg`` into the window (making room as of segment ``now``) and asks."""
        run = self.run
        assert run is not None
        before = self._tower()
        by_index = {s.index: s for s in self.segments}
        leaving = self._leaving(self.segment_tokens(seg), now, max_segments=self.segments_in_window)
        back = [label for label, *_ in self.segment_pieces(seg) if label in run.ref_of]
        contents = None
        if not back and self.images.processor is None:  # a new segment: its frames arrive before the step
            contents = self._contents(seg)
        st = run.begin(op, detail, ahead=contents or (),
                       leaving=[lab for i in leaving for lab, *_ in self.segment_pieces(by_index[i])])
        self._make_room(leaving, st)
        if back:  # a look-back: the seek is the agent's wait, in which the window prepares the recalls
            run.expect(back)
            run.idle("seek back")
        self._show(seg, contents)
        run.ask(question)
        self._end(run, st, before)

    def _look_back(self, old: Segment, cur: Segment) -> None:
        run = self.run
        assert run is not None
        self._show_and_ask("look-back", f"segment {old.index} (recalled)", old, cur.index,
                           f"Looking back at segment {old.index}: what was shown there? Answer in one sentence.")
        # compare: the looked-back segment right before the current one, in chronological order
        # (said before the step, so the idle time before it prepares that reorder)
        before = self._tower()
        by_index = {s.index: s for s in self.segments}
        pair = {old.index, cur.index}
        rest = [lab for i in self._resident if i not in pair for lab, *_ in self.segment_pieces(by_index[i])]
        side = [lab for i in sorted(pair) for lab, *_ in self.segment_pieces(by_index[i])]
        order = [lab for lab in run.labels if lab not in set(rest) | set(side)] + rest + side
        if order != run.labels:
            run.expect_order(order)
        st = run.begin("compare", f"segments {old.index} and {cur.index} side by side")
        if order != run.labels:
            run.reorder(order)
            st.notes.append(f"reordered: segment {old.index} right before segment {cur.index}")
        self._resident = [i for i in self._resident if i not in pair] + sorted(pair)
        run.ask(f"Do segment {old.index} and segment {cur.index} show the same scene? Answer yes or no.",
                choices=("yes", "no"))
        self._end(run, st, before)

    def summary(self) -> dict[str, Any]:
        """The run's totals plus the frames watched, vision-tower (or projection) runs, frames
        recalled and tower runs during look-backs / comparisons (0: a recall never runs it)."""
        assert self.run is not None
        out = self.run.summary()
        recalls = [r for s in self.run.steps for r in s.receipts if r.op == "recall"]
        frame_labels = {lab for s in self.segments for lab, _, m, _ in self.segment_pieces(s) if m == "frame"}
        out.update({
            "frames": sum(len(s.frames) for s in self.segments),
            "segments": len(self.segments),
            "image_path": self.images.kind,
            "tower_calls": self.images.tower_calls(self.run.window),
            "frame_recalls": sum(1 for r in recalls for ref in r.refs if self.run.label_of.get(ref) in frame_labels),
            "tower_calls_in_lookbacks": sum(n for _, op, n in self.tower_log if op in ("look-back", "compare")),
        })
        return out


__all__ = ["VideoAgent", "Segment", "load_frames", "INSTRUCTION"]
