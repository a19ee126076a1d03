"""VideoAgent: a real clip (built from skimage photographs, encoded and decoded with PyAV) watched
segment by segment through a window of a few segments, with look-backs (recalls: never re-encoded,
never through the vision tower again, counted) and comparison reorders; frames through the
image-span emulation on a text-only model and through the real Qwen2-VL vision path, whose window
equals the VL model's own forward over the same frames (its own M-RoPE positions); the recorded
trace replays; bad input is refused before the window is touched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from contextdeque.agents.base import AgentConfig, query_ids
from contextdeque.agents.measure import window_first_token
from contextdeque.agents.media import build_clip
from contextdeque.agents.video import VideoAgent, load_frames
from contextdeque.core.metrics import kl_divergence
from contextdeque.core.errors import BudgetError, MediaError, MediaTypeError, UnsupportedMediaError
from contextdeque.model.hf import HFBackend
from contextdeque.model.testing import build_tiny_model, build_tiny_vl_processor
from contextdeque.traces import read_trace
from contextdeque.window.receipt import PREPARED_SERVED
from helpers import assert_rereads_anticipated, replay_agent_trace, spy_expect


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return build_clip(tmp_path_factory.mktemp("clip") / "clip.mp4", frames_per_shot=6)


@pytest.fixture(scope="module")
def chat_backend(default_backend) -> HFBackend:
    model = build_tiny_model("llama", vocab_size=default_backend.tokenizer.vocab_size + 17, seed=11)
    return HFBackend(model, default_backend.tokenizer, name="tiny-llama-video")


@pytest.fixture(scope="module")
def vl_backend(default_backend) -> HFBackend:
    model = build_tiny_model("qwen2_vl", text_config={"vocab_size": default_backend.tokenizer.vocab_size + 17})
    return HFBackend(model, default_backend.tokenizer, name="tiny-qwen2-vl-video")


def check_run(agent: VideoAgent, budget: int) -> dict:
    run = agent.run
    steps = run.steps
    watches = [s for s in steps if s.op == "watch"]
    backs = [s for s in steps if s.op == "look-back"]
    compares = [s for s in steps if s.op == "compare"]
    assert len(watches) == len(agent.segments) and backs and len(compares) == len(backs)
    for s in backs + compares:  # a look-back recalls: nothing encoded, the tower does not run
        assert s.encodes == 0 and any(r.op == "recall" for r in s.receipts) == (s.op == "look-back")
    assert all(any(r.op == "reorder" for r in s.receipts) for s in compares)
    assert all(s.kl is not None and s.answer for s in watches + backs + compares)
    assert all(s.answer in ("yes", "no") for s in compares)  # the model compares
    assert all(sum(1 for lab in s.window if "/" not in lab and lab.startswith("seg")) <= agent.segments_in_window
               for s in steps)
    assert run.window.tokens_used <= budget
    summary = agent.summary()
    assert summary["frame_recalls"] > 0 and summary["tower_calls_in_lookbacks"] == 0
    assert summary["tower_calls"] <= summary["frames"]
    return summary


def test_load_frames_decodes_a_real_clip(clip):
    frames = load_frames(clip, every=2)
    assert len(frames) == 12 and frames[0].shape == (96, 128, 3) and frames[0].dtype == np.uint8
    assert float(np.abs(frames[0].astype(int) - frames[-1].astype(int)).mean()) > 10  # different photographs
    stacked = load_frames(np.stack(frames), every=3)  # frames given as one [N, H, W, 3] array
    assert len(stacked) == 4 and np.array_equal(stacked[1], frames[3])


def test_video_agent_on_a_tiny_model(chat_backend, clip, tmp_path, capsys, one_thread, monkeypatch):
    expected = spy_expect(monkeypatch)
    cfg = AgentConfig(budget_tokens=360, rank=8, max_new_tokens=3)
    agent = VideoAgent(chat_backend, cfg, image_tokens=16)
    agent.watch(clip, every=2)
    summary = check_run(agent, cfg.budget_tokens)
    # a look-back names the segment's chunks (header and frames, in order) before the seek: the
    # recalls find them prepared and the step's only forward is the query's own
    backs = [s for s in agent.run.steps if s.op == "look-back"]
    assert [len(group) for group, _ in expected] == [1 + agent.frames_per_segment] * len(backs)
    assert_rereads_anticipated(backs, "look-back")
    assert all(s.forwards == 1 for s in backs)
    # a new segment's frames arrive before its step and are read ahead then: its appends (and the
    # evictions that make room) run no forward in the step; each appended chunk is served what
    # the read-ahead prepared (its canonical at the front, else a stored patch), none deferred
    watches = [s for s in agent.run.steps if s.op == "watch"]
    assert all(s.forwards == 1 and s.idle_forwards > 0 for s in watches)
    compares = [r for s in agent.run.steps if s.op == "compare" for r in s.receipts if r.op == "reorder"]
    # the compare's order was named before its step (expect_order): the reorder finds it prepared
    assert compares and all(r.forwards == 0 and not r.deferred for r in compares)
    assert all(r.served and {what for _, what in r.served} <= set(PREPARED_SERVED) for r in compares)
    for r in (r for s in watches for r in s.receipts if r.op == "append"):
        assert r.forwards == 0 and r.encodes == 0
        assert r.refs[0] not in {ref for ref, _, _ in r.deferred}
    assert summary["image_path"] == "emulated" and summary["segments"] == 4
    assert summary["tower_calls"] == summary["frames"]  # one projection per frame, none on recall
    trace = read_trace(agent.run.write_trace(tmp_path / "video.jsonl"))
    ops = [e.op for e in trace.events]
    assert trace.header.generator == "video"
    assert {"recall", "reorder", "evict", "query"} <= set(ops)
    frames = [e for e in trace.events if e.op == "arrive" and e.modality == "frame"]
    assert len(frames) == summary["frames"]
    replay_agent_trace(tmp_path / "video.jsonl", capsys)


@torch.no_grad()
def test_qwen2_vl_frames_equal_the_models_own_forward(vl_backend, clip, one_thread):
    """Frames through the real Qwen2-VL processor and vision tower, placed on their M-RoPE grid
    by the window: under full-rank patches the window's next-token logits equal the VL model's
    own forward over the same token / pixel sequence (positions from its own ``get_rope_index``),
    at every query; a look-back never runs the tower."""
    proc = build_tiny_vl_processor("qwen2_vl")
    cfg = AgentConfig(budget_tokens=300, patch_policy="exact", max_new_tokens=2)
    # the tower's real forwards, counted on the module itself (not the window's own counter)
    runs: list[int] = []
    hook = vl_backend.model.model.visual.register_forward_hook(lambda *_: runs.append(1))
    per_step: list[tuple[str, int]] = []
    agent = VideoAgent(vl_backend, cfg, processor=proc, frames_per_segment=2,
                       on_step=lambda st: per_step.append((st.op, len(runs))))
    try:
        agent.watch(clip, every=3, segments=4)
    finally:
        hook.remove()
    summary = check_run(agent, cfg.budget_tokens)
    assert 0 < len(runs) == summary["tower_calls"] <= summary["frames"]
    before = [0] + [n for _, n in per_step[:-1]]
    lookbacks = [n - b for (op, n), b in zip(per_step, before) if op in ("look-back", "compare")]
    assert lookbacks and not any(lookbacks)  # a recalled frame never runs the tower
    assert summary["image_path"] == "vision" and all(s.kl <= 1e-4 for s in agent.run.steps if s.kl is not None)
    run = agent.run
    assert any(run.window.chunk(r).span != run.window.chunk(r).n_tokens for r in run.window.refs)  # an M-RoPE grid

    # the oracle: the model's own forward over root + the window's contents + a query
    model = vl_backend.model
    pixels = {lab: kw["_pixels"] for s in agent.segments for lab, kw, m, _ in agent.segment_pieces(s) if m == "frame"}
    ids: list[int] = list(vl_backend.root_ids)
    values, grids = [], []
    for ref in run.window.refs:
        chunk, label = run.window.chunk(ref), run.label_of[ref]
        if label in pixels:
            out = proc(images=[pixels[label]], return_tensors="pt")
            values.append(out["pixel_values"])
            grids.append(out["image_grid_thw"])
            ids += [int(model.config.image_token_id)] * chunk.n_tokens
        else:
            ids += [int(t) for t in chunk.token_ids.tolist()]
    q = query_ids(vl_backend, "Which segment shows a cat?")
    ids += q
    t = torch.tensor([ids])
    mm = (t == int(model.config.image_token_id)).int()
    out = model(input_ids=t, pixel_values=torch.cat(values), image_grid_thw=torch.cat(grids), mm_token_type_ids=mm,
                attention_mask=torch.ones_like(t))
    got = window_first_token(run.window, q).logits
    assert kl_divergence(out.logits[0, -1].float(), got) <= 1e-4
    # the window's M-RoPE positions are the model's own: the next position after the window
    pos, _ = model.model.get_rope_index(t, mm, image_grid_thw=torch.cat(grids))
    assert int(pos[-3:, 0, len(ids) - len(q)].max()) == run.window.next_position()


def test_bad_input_is_refused_and_the_window_is_unchanged(chat_backend, clip, tmp_path, one_thread):
    cfg = AgentConfig(budget_tokens=360, rank=4, max_new_tokens=2, measure=False)
    agent = VideoAgent(chat_backend, cfg, image_tokens=16)
    fresh = VideoAgent(chat_backend, cfg, image_tokens=16)
    agent.watch(clip, every=4, segments=2)
    run = agent.run
    before = (run.window.refs, run.window.generation, len(run.steps))
    not_video = tmp_path / "notes.mp4"
    not_video.write_text("not a video")
    rgba = [np.zeros((32, 32, 4), np.uint8)]
    from PIL import Image

    cases = [
        (MediaError, tmp_path / "missing.mp4"),          # no such file
        (MediaError, not_video),                          # not a video
        (MediaError, [b"\x89PNG not really"]),            # an unreadable frame
        (MediaTypeError, [42]),                           # not a frame at all
        (UnsupportedMediaError, rgba),                    # RGBA pixels
        (UnsupportedMediaError, [Image.new("CMYK", (16, 16))]),  # an unsupported image mode
        (MediaTypeError, 3.5),                            # not a video
    ]
    for err, bad in cases:
        for a in (agent, fresh):
            with pytest.raises(err):
                a.watch(bad)
    small = VideoAgent(chat_backend, AgentConfig(budget_tokens=60), image_tokens=16)
    with pytest.raises(BudgetError, match="segment"):  # a segment larger than the window
        small.watch(clip, every=4)
    assert fresh.run is None and small.run is None  # nothing was read
    assert agent.run is run and (run.window.refs, run.window.generation, len(run.steps)) == before


@pytest.mark.slow
def test_video_agent_on_the_default_model(default_backend, clip, tmp_path, capsys, one_thread):
    cfg = AgentConfig(budget_tokens=400, max_new_tokens=8)
    agent = VideoAgent(default_backend, cfg, image_tokens=24)
    agent.watch(clip, every=2, segments=4)
    summary = check_run(agent, cfg.budget_tokens)
    assert summary["tokens_prefilled"] > 0 and summary["prefill_avoided_vs_reprefill"] is not None
    replay_agent_trace(agent.run.write_trace(tmp_path / "video.jsonl"), capsys)


def test_demo_video_agent_on_a_tiny_qwen2_vl(tmp_path, capsys, one_thread):
    """`contextdeque demo --agent video` end to end on a tiny random-weight Qwen2-VL (its frames
    through the real processor and vision tower); the trace it writes replays."""
    import json

    from contextdeque.cli import main

    trace = tmp_path / "demo-video.jsonl"
    assert main(["demo", "--agent", "video", "--model", "tiny:qwen2_vl", "--json", "--max-new-tokens", "2",
                 "--segments", "4", "--trace", str(trace)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["agent"] == "video" and out["image_path"] == "vision" and out["segments"] == 4
    assert out["frame_recalls"] > 0 and out["tower_calls_in_lookbacks"] == 0
    assert 0 < out["tower_calls"] <= out["frames"] and len(out["question_kl"]) == len(out["answers"])
    replay_agent_trace(trace, capsys)


def test_agents_take_placement_and_fidelity_target(chat_backend, clip, tmp_path, capsys, one_thread):
    """An agent's window is configured from AgentConfig: the placement scheduler places appended
    and recalled chunks (a segment's frames may interleave), the safety envelope picks each
    patch's rank; look-backs still never run the tower and the trace replays."""
    cfg = AgentConfig(budget_tokens=360, rank=8, max_new_tokens=2, placement="scheduler", fidelity_target=0.99)
    agent = VideoAgent(chat_backend, cfg, image_tokens=16)
    agent.watch(clip, every=2)
    ctx = agent.run.window.context
    assert type(ctx.placement).__name__ != "ArrivalPlacement" and ctx.fidelity_target == 0.99
    check_run(agent, cfg.budget_tokens)
    replay_agent_trace(agent.run.write_trace(tmp_path / "video-sched.jsonl"), capsys)
