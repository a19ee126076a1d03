"""Video agent: segments of frames re-examined under changing prompts, with look-backs to
earlier segments and comparison reorders (two segments placed side by side).

The window holds the instruction and the last ``keep_segments`` segments (each a few frames of
256-1,024 tokens plus a short caption). Every few segments the prompt changes and the agent
looks back at an earlier segment (recall), sometimes reordering the window to put it next to the
current one for comparison. Steps record their idle time: the segment's capture (500-2,000 ms)
before its frames arrive, the fetch of an earlier segment's frames (300-1,500 ms) before a
look-back, which the agent announces (``expect``; with ``order``, the comparison's reorder).
"""

from __future__ import annotations

from .builder import TraceBuilder, content_hash
from .generators import header, register_generator, rng_for
from .io import Trace


@register_generator("video")
def generate_video(seed: int = 0, segments: int = 16, keep_segments: int = 3, frames: tuple[int, int] = (2, 4),
                   lookback: float = 0.35, compare: float = 0.5) -> Trace:
    rng = rng_for("video", seed)
    idle = rng_for("video-idle", seed)  # its own stream: the trace's other draws do not change
    b = TraceBuilder(header("video", seed, segments=segments, keep_segments=keep_segments))
    frame_tokens = rng.choice([256, 324, 576, 1024])  # one resolution per video
    t = 0.0
    b.step(t=t, label="instruction", idle=0.0)
    b.arrive("instruction", rng.randint(60, 200), content_hash("video", seed, "instruction"))
    seg_chunks: dict[int, list[str]] = {}
    live: list[int] = []

    def show(sid: int) -> None:
        for c in seg_chunks[sid]:
            b.arrive(c, sizes[c], hashes[c], "frame" if ".f" in c else "text")
        live.append(sid)

    def hide(sid: int) -> None:
        for c in seg_chunks[sid]:
            b.evict(c)
        live.remove(sid)

    sizes: dict[str, int] = {}
    hashes: dict[str, str] = {}
    prompt = 0
    for s in range(segments):
        t += rng.uniform(2000, 10000)
        b.step(t=round(t, 1), label=f"segment{s}", idle=idle.uniform(500, 2000))
        ids = [f"seg{s}.f{k}" for k in range(rng.randint(*frames))] + [f"seg{s}.caption"]
        for c in ids:
            sizes[c] = frame_tokens if ".f" in c else rng.randint(20, 80)
            hashes[c] = content_hash("video", seed, c)
        seg_chunks[s] = ids
        show(s)
        while len(live) > keep_segments:
            hide(live[0])
        if s and s % 3 == 0:
            prompt += 1
            b.arrive(f"prompt{prompt}", rng.randint(20, 60), content_hash("video", seed, "prompt", prompt))
        b.query(rng.randint(20, 60), rng.randint(10, 60))
        if s >= keep_segments and rng.random() < lookback:
            old = rng.randrange(0, s - keep_segments + 1)
            if old not in live:
                if len(live) >= keep_segments:
                    hide(live[0])
                for c in seg_chunks[old]:  # the agent asks for that segment
                    b.expect(c)
                order = None
                if rng.random() < compare:
                    # comparison: the looked-back segment right before the current one (the agent
                    # says so with the look-back: the window prepares that order too)
                    cur = seg_chunks[s]
                    back = seg_chunks[old]
                    after = list(b.window) + [c for c in back if c not in b.window]
                    order = [c for c in after if c not in cur and c not in back] + back + cur
                    b.expect_order(order)
                b.step(label=f"lookback{s}", idle=idle.uniform(300, 1500))  # the earlier frames are fetched
                show(old)
                if order is not None:
                    b.reorder(order)
                b.query(rng.randint(20, 60), rng.randint(10, 60))
    return b.build(name=f"video-{seed}")
