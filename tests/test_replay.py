"""Cost-model replay: JSON fields, determinism (parallel too), bad input, calibration, plots."""

from __future__ import annotations

import json

import pytest

from contextdeque.cli import main
from contextdeque.core.errors import ArgumentError, BudgetError, TraceError, TraceVersionError
from contextdeque.replay import CostModel, ReplayConfig, Replayer, load_calibration, save_calibration
from contextdeque.replay.run import parse_combos, replay_many
from contextdeque.scheduler import PolicyError
from contextdeque.traces import generate, write_trace


@pytest.fixture(scope="module")
def trace_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    out = []
    for kind in ("web", "video", "doc"):
        t = generate(kind, seed=7)
        out.append(str(write_trace(d / f"{kind}-7.jsonl", t.header, t.events)))
    return out


def test_json_fields_and_byte_identical_in_parallel(trace_files, capsys):
    args = ["replay", *trace_files, "--placement", "arrival,scheduler", "--arm", "patch,prefix_cache", "--json"]
    assert main([*args, "--jobs", "1"]) == 0
    one = capsys.readouterr().out
    assert main([*args, "--jobs", "2"]) == 0
    two = capsys.readouterr().out
    assert one == two
    doc = json.loads(one)
    assert len(doc["results"]) == 3 * 2 * 2
    for r in doc["results"]:
        assert isinstance(r["trace"], str) and r["placement"] in ("arrival", "scheduler") and r["eviction"] == "lru"
        assert isinstance(r["tokens_prefilled"], int) and isinstance(r["patch_forms"], int)
        assert isinstance(r["est_seconds"], float) and r["est_seconds"] > 0
        assert set(r["bytes"]) == {"device", "host", "disk"}
    assert doc["calibration"]["note"]


@pytest.mark.parametrize("kind", ["web", "video", "doc"])
def test_patch_arm_prefills_less_than_prefix_cache_and_reprefill(kind):
    """Eager patch arm: fewer tokens in total than the prefix cache on web and video (on doc it
    prefills more: every append is a canonical plus a conditioned forward, where the prefix cache
    extends its chain once). Latency-first (patch-latency, the default): fewer than the prefix
    cache on every kind, on the critical path and in total (its heal, in idle time, included)."""
    tot = {"patch": 0, "patch-latency": 0, "prefix_cache": 0, "reprefill": 0}
    crit = dict(tot)
    heal = 0
    for seed in range(3):
        t = generate(kind, seed=seed)
        for arm in tot:
            r = Replayer(t, "arrival", "lru", arm).run()
            tot[arm] += r.tokens_prefilled
            crit[arm] += r.tokens_prefilled - r.heal_tokens
            heal += r.heal_tokens if arm == "patch-latency" else -r.heal_tokens
    assert crit["patch-latency"] < crit["prefix_cache"] < tot["reprefill"], crit
    assert heal > 0 and tot["patch-latency"] < tot["patch"], tot
    # content no one re-reads elsewhere never gets a canonical: fewer tokens in total too
    assert tot["patch-latency"] < tot["prefix_cache"], tot
    assert crit["patch"] == tot["patch"] and crit["prefix_cache"] == tot["prefix_cache"]  # nothing deferred
    if kind != "doc":
        assert tot["patch"] < tot["prefix_cache"] < tot["reprefill"], tot


def test_latency_first_append_costs_a_prefix_cache_append_and_nothing_more():
    """A new chunk behind the window: one forward of its tokens after the window (as the prefix
    cache's append), and no canonical until something re-reads it elsewhere: read where it was
    forwarded, it never costs a second forward. Evicted and recalled, it is forwarded again where
    it re-enters (the prefix cache's cost for it); moved by a reorder, re-forwarded at the heal."""
    from contextdeque.traces import TraceBuilder, TraceHeader

    b = TraceBuilder(TraceHeader(generator="unit"))
    b.arrive("a", 100, "ha")
    b.arrive("b", 50, "hb")
    r = Replayer(b.build(), "arrival", "lru", "patch-latency").run()
    # a: at the front, its canonical; b: 50 after the window; the heal has nothing to do
    assert r.tokens_prefilled == 150 and r.heal_tokens == 0 and r.encodes == 1 and r.patch_forms == 0
    e = Replayer(b.build(), "arrival", "lru", "patch").run()
    assert e.tokens_prefilled == 200 and e.heal_tokens == 0  # eager: b's canonical and b's conditioned forward now
    assert r.est_seconds < e.est_seconds

    b.step()
    b.evict("b")
    b.recall("b")
    b.step()
    r2 = Replayer(b.build(), "arrival", "lru", "patch-latency").run()
    assert r2.tokens_prefilled == 200 and r2.heal_tokens == 0 and r2.encodes == 1  # the recall: 50 more, forwarded

    # latency-shared: every canonical while healing (b's at the step; its patch is the difference)
    b2 = TraceBuilder(TraceHeader(generator="unit"))
    b2.arrive("a", 100, "ha")
    b2.arrive("b", 50, "hb")
    s = Replayer(b2.build(), "arrival", "lru", "patch-latency-shared").run()
    assert s.tokens_prefilled == 200 and s.heal_tokens == 50 and s.patch_forms == 1 and s.patch_bytes > 0
    b2.step()
    b2.evict("b")
    b2.recall("b")
    b2.step()
    s2 = Replayer(b2.build(), "arrival", "lru", "patch-latency-shared").run()
    assert s2.tokens_prefilled == 200 and s2.patch_hits == 1  # the recall reads its stored patch: no forward

    m = TraceBuilder(TraceHeader(generator="unit"))
    for cid, n in (("a", 100), ("b", 50), ("c", 30)):
        m.arrive(cid, n, "h" + cid)
    m.step()
    m.reorder(["a", "c", "b"])
    m.step()
    r3 = Replayer(m.build(), "arrival", "lru", "patch-latency").run()
    assert r3.heal_tokens == 80 and r3.heal_forwards == 2 and r3.encodes == 1  # b and c re-forwarded, no canonical
    assert r3.tokens_prefilled == 100 + 50 + 30 + 80


def test_kvcapsule_and_selection_rules_registered_and_priced():
    from contextdeque.replay import REUSE_COSTS, make_reuse

    for name in ("kvcapsule-linear", "mm-shiftkv", "snapkv", "streamingllm", "patch-latency", "patch-latency-shared"):
        assert name in REUSE_COSTS
    sel = make_reuse("snapkv-64")
    assert sel.budget == 64 and sel.label == "snapkv-64"
    for bad in ("snapkv-0", "snapkv-x", "patch-32", "nope-8"):
        with pytest.raises(PolicyError):
            make_reuse(bad)
    assert parse_combos(["arrival:lru:mm-shiftkv-128"], [], [], []) == [("arrival", "lru", "mm-shiftkv-128")]
    t = generate("web", seed=1)
    cfg = ReplayConfig(device_bytes=200 * CostModel().kv_bytes_per_token * 64)  # a small pool: canonicals spill
    runs = {a: Replayer(t, "arrival", "lru", a, config=cfg).run() for a in
            ("patch", "kvcapsule-linear", "reprefill", "snapkv-64", "streamingllm-4096")}
    assert runs["snapkv-64"].arm == "snapkv-64"
    # selection: the papers' prefill-only protocol prefills what re-prefill does; it holds fewer rows
    assert runs["snapkv-64"].tokens_prefilled == runs["reprefill"].tokens_prefilled
    assert runs["snapkv-64"].bytes["device"] < runs["streamingllm-4096"].bytes["device"]
    # compressed at rest: same forms, more canonicals fit the device, fewer bytes spilled and moved
    # between tiers (a chunk that leaves is demoted either way: its recall reads it from below)
    cap, pat = runs["kvcapsule-linear"], runs["patch"]
    assert cap.patch_forms == pat.patch_forms
    assert cap.traffic["evicted"]["device"] < pat.traffic["evicted"]["device"] and cap.bytes["host"] < pat.bytes["host"]


def test_bad_inputs_are_typed_and_nothing_runs(tmp_path, trace_files, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "contextdeque-trace", "version": 1, "generator": "t"}\n{"op": "arrive", "id": "a", "tokens": 5, "hash": "h"}\n{"op": "recall", "id": "zzz"}\n')
    with pytest.raises(TraceError) as e:
        replay_many([trace_files[0], str(bad)], [("arrival", "lru", "patch")])
    assert e.value.line == 3
    assert main(["replay", trace_files[0], str(bad), "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "bad.jsonl:3" in captured.err  # nothing half-replayed, location given
    newer = tmp_path / "newer.jsonl"
    newer.write_text('{"format": "contextdeque-trace", "version": 99, "generator": "t"}\n')
    with pytest.raises(TraceVersionError):
        replay_many([str(newer)], [("arrival", "lru", "patch")])
    with pytest.raises(BudgetError):
        replay_many(trace_files, [("arrival", "lru", "patch")], config=ReplayConfig(budget_tokens=50))
    assert main(["replay", trace_files[0], "--budget-tokens", "50"]) == 1
    err = capsys.readouterr().err
    assert "budget" in err and "web-7.jsonl:" in err and "chunk '" in err  # where the too-large chunk arrives
    with pytest.raises(PolicyError):
        parse_combos(["arrival:lru"], [], [], [])
    with pytest.raises(PolicyError):
        parse_combos(None, ["teleport"], ["lru"], ["patch"])
    assert len(parse_combos(["arrival:*:patch"], [], [], [])) == 3


def test_calibration_saved_and_used(tmp_path, tiny_backend_factory, one_thread):
    from contextdeque.replay.calibrate import calibrate

    be = tiny_backend_factory("llama")
    model = calibrate(be, lengths=(16, 48), rank=4, repeats=1, disk_dir=str(tmp_path))
    assert model.source == "calibration" and model.fingerprint == be.fingerprint
    assert all(tps > 0 for _, tps in model.prefill) and model.apply_bytes_per_s > 0
    assert [n for n, _ in model.prefill] == [be.root_len + 16, be.root_len + 48]
    assert model.extra["device"] == "cpu" and model.extra["lengths"] == [16, 48]  # where the speeds were measured
    path = save_calibration(model, tmp_path)
    got, note = load_calibration(be.fingerprint, tmp_path)
    assert got == model and str(path) in note
    fallback, why = load_calibration("0" * 32, tmp_path)
    assert fallback.source == "defaults" and "defaults" in why
    t = generate("video", seed=0)
    a = Replayer(t, cost=got).run()
    b = Replayer(t, cost=CostModel()).run()
    assert a.patch_forms == b.patch_forms and a.est_seconds != b.est_seconds


def test_a_calibration_file_with_foreign_fields_is_refused(tmp_path):
    good = CostModel().to_json()
    p = tmp_path / "cal.json"
    p.write_text(json.dumps({**good, "wall_s": 3.0}))
    with pytest.raises(ArgumentError, match="unknown fields \\['wall_s'\\]"):
        load_calibration(path=p)
    p.write_text(json.dumps({k: v for k, v in good.items() if k != "prefill"}))
    with pytest.raises(ArgumentError, match="no prefill table"):
        load_calibration(path=p)


def test_the_h100_calibration_in_docs_loads():
    """docs/gpu-results/h100's calibration (measured on a lent H100; the note's hit-rate commands
    read it) is a calibration this version reads, and says where it was measured."""
    from pathlib import Path

    for p in sorted((Path(__file__).parents[1] / "docs/gpu-results/h100").glob("calibration-*.json")):
        model, _ = load_calibration(path=p)
        assert "H100" in model.extra["device"] and model.tokens_per_s(2048) > 0 and model.svd_s_per_token > 0


@pytest.mark.parametrize("lengths", ["48,16", "0,16", "16,16", "64,x", ""])
def test_calibrate_lengths_are_increasing_positive_counts(lengths, capsys):
    assert main(["calibrate", "--model", "tiny:llama", "--lengths", lengths]) == 2  # before any model loads
    assert "--lengths" in capsys.readouterr().err


def test_plot_writes_png(tmp_path, trace_files):
    out = tmp_path / "r.png"
    assert main(["replay", trace_files[1], "--arm", "patch,reprefill", "--jobs", "1", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_example_generates_replays_and_plots(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "replay_agents.py"
    spec = importlib.util.spec_from_file_location("replay_agents", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(tmp_path / "out"), "--jobs", "1"]) == 0
    assert sorted(p.name for p in (tmp_path / "out" / "traces").glob("*.jsonl")) == ["doc-0.jsonl", "video-0.jsonl", "web-0.jsonl"]
    assert (tmp_path / "out" / "replay.png").read_bytes()[:4] == b"\x89PNG"
    assert "replay (cost model)" in capsys.readouterr().out


def test_fidelity_mode_on_a_tiny_model(tiny_backend_factory, one_thread, tmp_path):
    from contextdeque.replay.fidelity import run_fidelity_mode

    be = tiny_backend_factory("qwen2")
    t = generate("video", seed=3, segments=5)
    p = str(write_trace(tmp_path / f"{t.name}.jsonl", t.header, t.events))
    combos = [("arrival", "lru", "patch"), ("arrival", "belady", "patch"), ("scheduler", "lru", "blind"),
              ("arrival", "lru", "prefix_cache")]
    out = run_fidelity_mode([p], combos, 2, seed=1, scale=1 / 32, backend=be)
    assert set(out) == {(t.name, *c) for c in combos}
    patch, blind = out[(t.name, "arrival", "lru", "patch")], out[(t.name, "scheduler", "lru", "blind")]
    assert patch == out[(t.name, "arrival", "belady", "patch")]  # eviction does not change what the model sees
    assert patch["fidelity_queries"] == 2 and patch["kl"] >= 0 and patch["ttft_ratio"] > 0
    assert blind["eta"] in (None, 0.0) or abs(blind["eta"]) < 1e-9
    if patch["eta"] is not None:
        assert patch["eta"] > 0  # the patch closes part of blind reuse's gap
    assert out[(t.name, "arrival", "lru", "prefix_cache")]["kl"] < 1e-6  # exact prefix reuse + re-prefill


def test_fidelity_mode_drives_patch_latency_and_refuses_priced_only_arms(tiny_backend_factory, one_thread, tmp_path):
    from contextdeque.replay.fidelity import run_fidelity_mode

    t = generate("video", seed=3, segments=5)
    p = str(write_trace(tmp_path / f"{t.name}.jsonl", t.header, t.events))
    for arm in ("snapkv-64", "kvcapsule-linear"):
        with pytest.raises(PolicyError, match="does not drive"):
            run_fidelity_mode([p], [("arrival", "lru", arm)], 1, backend=object())  # refused before any model work
    be = tiny_backend_factory("qwen2")
    out = run_fidelity_mode([p], [("arrival", "lru", "patch-latency")], 2, seed=1, scale=1 / 32, backend=be)
    r = out[(t.name, "arrival", "lru", "patch-latency")]
    assert r["fidelity_queries"] == 2 and r["kl"] >= 0
    assert r["kl_healed_by_step"]  # a latency-first window had work queued at a sampled query: measured after heal()
