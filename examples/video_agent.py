"""A video agent watching a clip segment by segment, looking back and comparing.

With no video given, the clip is built from scikit-image's photographs (a pan, a zoom and a
drifting crop over each), encoded with PyAV and decoded back. The window holds two segments; an
earlier segment that left is recalled for a look-back (never re-encoded, the vision tower — here
the text-only model's image-span emulation — does not run again: counted), then reordered next to
the current one for a comparison. On the default text-only model the frames carry **no visual
understanding**; with a Qwen2-VL model and its processor they go through its own vision tower.

Run:  .venv/bin/python examples/video_agent.py [VIDEO_FILE]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from contextdeque.agents.base import AgentConfig
from contextdeque.agents.video import VideoAgent


def main(backend: Any = None, video: Any = None, processor: Any = None, max_new_tokens: int = 16,
         out_dir: str | Path | None = None) -> VideoAgent:
    if backend is None:
        from contextdeque.model import load_model

        backend = load_model()
    config = AgentConfig(budget_tokens=400, rank=32, max_new_tokens=max_new_tokens)
    agent = VideoAgent(backend, config, processor=processor, frames_per_segment=3, segments_in_window=2,
                       image_tokens=24)
    run = agent.watch(video, every=2, segments=4)
    for s in run.steps:
        line = f"{s.index:3d} {s.op:11s} {s.detail[:40]:40s} fwd {s.forwards:3d} encodes {s.encodes:2d}"
        if s.kl is not None:
            line += f" | KL {s.kl:.1e} -> {s.answer!r}"
        print(line + (f"  ({'; '.join(s.notes)})" if s.notes else ""))
    summary = agent.summary()
    print(f"{summary['frames']} frames in {summary['segments']} segments through the {summary['image_path']} image path: "
          f"{summary['tower_calls']} tower runs; {summary['frame_recalls']} frames recalled, "
          f"{summary['tower_calls_in_lookbacks']} tower runs in look-backs")
    out = Path(out_dir or tempfile.mkdtemp(prefix="contextdeque-video-"))
    print("replay trace:", run.write_trace(out / "video.jsonl"))
    return agent


if __name__ == "__main__":
    main(video=sys.argv[1] if len(sys.argv) > 1 else None)
