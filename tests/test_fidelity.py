"""Fidelity metrics (reference values), the probe set, and a smoke run of the harness and CLI on
a tiny random model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from contextdeque.eval.fidelity.harness import HarnessConfig, recall_plan, run_fidelity
from contextdeque.eval.fidelity.metrics import bytes_report, eta, flip_recover, n_flips, pooled_eta, summarize
from contextdeque.core.metrics import kl_divergence, ulp, ulp_error, ulp_error_at_scale
from contextdeque.eval.fidelity.probes import (
    MAX_CHUNK_TOKENS,
    MIN_CHUNK_TOKENS,
    image_span_embeddings,
    probe_set,
    query_suffix,
    tokenize,
)

@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny-model work is dominated by per-op overhead: one thread avoids oversubscribing a
    shared 2-core runner (several times faster there); restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------- metrics


def test_kl_reference_values():
    p = torch.log(torch.tensor([0.5, 0.5], dtype=torch.float64))
    q = torch.log(torch.tensor([0.9, 0.1], dtype=torch.float64))
    want = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_divergence(p, q) == pytest.approx(want, rel=1e-12)
    assert kl_divergence(p + 3.0, q - 1.0) == pytest.approx(want, rel=1e-12)  # logits, not probabilities
    assert kl_divergence(q, q) == 0.0
    assert kl_divergence(q, p) == pytest.approx(0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5), rel=1e-12)
    with pytest.raises(ValueError):
        kl_divergence(torch.zeros(3), torch.zeros(4))


def test_eta_and_pooled_eta():
    assert eta(0.2, 0.05) == pytest.approx(0.75)
    assert eta(0.2, 0.2) == 0.0
    assert eta(0.2, 0.4) == pytest.approx(-1.0)  # worse than blind
    assert eta(0.0, 0.0) is None  # no gap, no ratio
    assert eta(1e-5, 0.0, min_gap=1e-4) is None
    assert pooled_eta([0.1, 0.3], [0.0, 0.1]) == pytest.approx(0.75)
    assert pooled_eta([0.0], [0.0]) is None


def test_flip_recover():
    ref = ["a", "b", "c", "d"]
    blind = ["a", "x", "y", "d"]  # items 1 and 2 flip
    assert flip_recover(ref, blind, ["a", "b", "z", "d"]) == 0.5
    assert flip_recover(ref, blind, ref) == 1.0
    assert flip_recover(ref, blind, blind) == 0.0
    assert flip_recover(ref, ref, blind) is None  # nothing flips: undefined
    assert n_flips(ref, blind) == 2
    with pytest.raises(ValueError):
        flip_recover(ref, blind, ["a"])


def test_ulp_reference_values():
    x = torch.tensor([1.0, 1.5, 2.0, 0.75, 0.0])
    assert ulp(x, torch.float32).tolist() == [2.0**-23, 2.0**-23, 2.0**-22, 2.0**-24, 2.0**-149]
    assert ulp(torch.tensor([1.0, 3.0]), torch.bfloat16).tolist() == [2.0**-7, 2.0**-6]
    one = torch.tensor([1.0], dtype=torch.float64)
    nxt = torch.nextafter(torch.tensor([1.0]), torch.tensor([2.0])).to(torch.float64)
    assert ulp_error(nxt, one, torch.float32).item() == 1.0
    assert ulp_error(one + 3 * 2.0**-7, one, torch.bfloat16).item() == pytest.approx(3.0)
    assert ulp_error(-one, -one, torch.float32).item() == 0.0
    ref = torch.tensor([0.0, -4.0, 1.0])  # scale 4: one fp32 ULP there is 2^-21
    assert ulp_error_at_scale(ref + torch.tensor([2.0**-21, 0.0, 0.0]), ref, torch.float32) == 1.0
    assert ulp_error_at_scale(ref, ref, torch.bfloat16) == 0.0


def test_bytes_report_and_summaries():
    class _N:
        def __init__(self, n):
            self.nbytes = n

    r = bytes_report([_N(1000), _N(3000)], [_N(500)])
    assert (r.canonical, r.patch, r.ratio) == (4000, 500, 0.125)
    assert r.as_dict() == {"canonical": 4000, "patch": 500, "ratio": 0.125}
    assert summarize([1.0, None, 3.0, float("nan")]) == {"median": 2.0, "mean": 2.0, "n": 2}
    assert summarize([None]) == {"median": None, "mean": None, "n": 0}


# ---------------------------------------------------------------------------- probes


def test_probe_set_is_deterministic_and_well_formed():
    a, b = probe_set(), probe_set()
    assert a == b
    assert len(a) >= 32
    assert {i.family for i in a} == {"pydoc", "binding", "image"}
    assert len({i.id for i in a}) == len(a)
    for it in a:
        assert 2 <= len(it.chunks) <= 6, it.id
        assert it.question and it.answer
        for c in it.chunks:
            assert (c.kind == "text" and c.text) or (c.kind == "image" and c.image)
            if c.kind == "image":
                assert MIN_CHUNK_TOKENS <= c.grid[0] * c.grid[1] <= MAX_CHUNK_TOKENS
    assert sum(len(i.chunks) >= 4 for i in a) >= 8  # orbit needs 3 antecedents + the chunk
    assert sum(recall_plan(len(i.chunks), 2) is not None for i in a) >= 8
    assert [i.id for i in probe_set(5)] == [i.id for i in a[:5]]


def test_probe_chunks_fit_the_default_tokenizer(default_backend):
    for it in probe_set():
        for c in it.chunks:
            if c.kind == "text":
                n = len(tokenize(default_backend, c.text))
                assert MIN_CHUNK_TOKENS <= n <= MAX_CHUNK_TOKENS, (it.id, n)
    assert query_suffix(default_backend) == "<|im_end|>\n<|im_start|>assistant\n"


def test_emulated_image_span_is_seeded_and_scaled():
    a = image_span_embeddings("camera", (4, 5), 64, target_norm=3.0)
    b = image_span_embeddings("camera", (4, 5), 64, target_norm=3.0)
    c = image_span_embeddings("coffee", (4, 5), 64, target_norm=3.0)
    assert a.shape == (20, 64) and torch.equal(a, b)
    torch.testing.assert_close(a.norm(dim=-1), torch.full((20,), 3.0))
    assert not torch.allclose(a, c)  # the pixels matter
    assert torch.isfinite(image_span_embeddings("horse", (3, 3), 32, 1.0)).all()  # boolean image


def test_recall_plan():
    assert recall_plan(4, 2) is None
    assert recall_plan(5, 2) == (1, [0], [3, 4])
    assert recall_plan(6, 3) is None
    assert recall_plan(7, 3) == (1, [0], [4, 5, 6])


# ---------------------------------------------------------------------------- smoke runs


def test_harness_smoke_on_a_tiny_model(tiny_backend_factory):
    be = tiny_backend_factory("llama", seed=0)
    items = [i for i in probe_set() if i.id in ("binding-03", "image-02")]  # 5 chunks; text + 2 images
    cfg = HarnessConfig(ranks=(4, 8), max_chunk_tokens=14, image_grid=(2, 3), max_decode=2)
    res = run_fidelity(be, items, cfg)
    s = res.summary
    assert s["n_items"] == 2 and s["n_samples"] == {"main": 2, "orbit": 6, "recall": 1, "select": 2}
    arms = s["arms"]
    for name in ("blind", "patch-r4", "patch-r8", "patch-r32", "patch-full", "cacheblend-15", "cacheblend-matched",
                 "epic-32", "epic-matched", "vlcache-15", "prefix_cache", "orbit-r32", "orbit-exact-r32",
                 "recall-fresh-r32", "recall-stale-r32", "kvcapsule-linear", "kvcapsule-linear-blind"):
        assert name in arms, name
    assert arms["reprefill"]["median_kl"] == 0.0
    assert arms["blind"]["median_kl"] > 1e-6
    assert arms["patch-full"]["median_kl"] < 1e-8
    assert arms["prefix_cache"]["median_kl"] < 1e-8
    assert arms["patch-full"]["median_eta"] == pytest.approx(1.0, abs=1e-6)
    assert arms["blind"]["median_eta"] == 0.0
    assert set(s["eta_vs_rank"]) == {"4", "8", "32", "full"}
    assert s["kv_ulp"]["relocation"]["median"] < 64
    assert s["kv_ulp"]["patch-full"]["at_scale_max"] < 256  # fp32 rounding, not a deficit
    assert set(s["by_family"]) == {"binding", "image"}
    assert set(s["targets"]) >= {"patch-full median KL", "recall fresh median eta"}


def test_cli_json_smoke(capsys, tmp_path):
    from contextdeque.cli import main

    png = tmp_path / "fid.png"
    rc = main(["fidelity", "--model", "tiny:llama", "--items", "3", "--ranks", "4,16", "--max-chunk-tokens", "10",
               "--image-grid", "2x2", "--arms", "patch,cacheblend,epic", "--json", "--per-item", "--threads", "1",
               "--plot", str(png)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_items"] == 3
    for name in ("blind", "patch-r16", "patch-r32", "patch-full", "cacheblend-matched", "epic-matched"):
        assert {"median_eta", "median_kl", "bytes_fraction", "flip_recover"} <= set(out["arms"][name])
    assert "patch_beats_matched_share" in out
    assert len(out["samples"]) == 3 and out["samples"][0]["kl"]["reprefill"] == 0.0
    assert png.exists() and png.stat().st_size > 1000


def test_cli_fidelity_target_reports_eta_ranks_bytes_and_misses(capsys, tmp_path, monkeypatch):
    """``--fidelity-target``: target arms beside the fixed ranks, with median and 10th-percentile η,
    directions and bytes per arm, and the miss count; the model's envelope is calibrated (cached
    under the cache dir) and reported, then read back by ``verify-model`` and ``calibrate``."""
    from contextdeque.cli import main

    monkeypatch.setenv("CONTEXTDEQUE_CACHE", str(tmp_path))
    args = ["--model", "tiny:llama", "--items", "3", "--ranks", "4", "--max-chunk-tokens", "12", "--image-grid", "2x2",
            "--arms", "patch", "--json", "--threads", "1", "--fidelity-target", "0.9,0.99", "--max-patch-fraction", "0.02"]
    assert main(["fidelity", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fidelity_envelope"]["n_items"] >= 1 and out["max_patch_fraction"] == 0.02
    for name in ("target-0.9", "target-0.99", "patch-r4"):
        a = out["arms"][name]
        assert {"median_eta", "p10_eta", "mean_directions_k", "mean_directions_v", "patch_bytes"} <= set(a)
    t = out["arms"]["target-0.99"]
    assert t["misses"] == t["patches"] > 0  # a 2% cap binds on every patch, and each miss is counted
    assert t["bytes_fraction"] <= 0.02 + 1e-9
    assert main(["verify-model", "tiny:llama", "--json"]) in (0, 1)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["fidelity_envelope"]["fingerprint"] == out["fidelity_envelope"]["fingerprint"]
    assert main(["calibrate", "--model", "tiny:llama", "--only-envelope", "--threads", "1", "--max-chunk-tokens", "12",
                 "--image-grid", "2x2"]) == 0
    printed = capsys.readouterr().out
    assert "fidelity envelope of tiny-llama" in printed and str(tmp_path) in printed
    assert "map η (q0.25)" in printed and "sensitivity per layer" not in printed  # opt-in, not measured here
    assert main(["calibrate", "--model", "tiny:llama", "--only-envelope", "--sensitivity", "--threads", "1",
                 "--max-chunk-tokens", "12", "--image-grid", "2x2"]) == 0
    printed = capsys.readouterr().out
    assert "sensitivity per layer, K:" in printed and "sensitivity per layer, V:" in printed
    from contextdeque.model.envelope import load_envelope

    assert load_envelope(out["fidelity_envelope"]["fingerprint"]).sensitivity_k  # cached with them
    assert main(["calibrate", "--model", "tiny:llama", "--sensitivity"]) == 2  # no envelope asked for
    assert "--only-envelope" in capsys.readouterr().err


def test_a_failing_arm_is_reported_and_the_run_completes(capsys, monkeypatch):
    """The capsule fit raising on one item (as a singular key Gram once did) and the recall group
    raising on every item: the CLI run still exits 0, every other arm is scored, and the JSON
    summary and stderr name each failure with its items."""
    from contextdeque.cli import main
    from contextdeque.eval.arms.kvcapsule import KVCapsuleArm
    from contextdeque.eval.fidelity import harness

    real_run, calls = KVCapsuleArm.run, []

    def flaky(self, request):
        calls.append(1)
        if len(calls) <= 2:  # both capsule arms of the first item
            raise RuntimeError("Pivots given to lu_solve must all be greater or equal to 1")
        return real_run(self, request)

    def broken_group(*_args):
        raise ValueError("recall went wrong")

    monkeypatch.setattr(KVCapsuleArm, "run", flaky)
    monkeypatch.setitem(harness._GROUPS, "recall", broken_group)
    rc = main(["fidelity", "--model", "tiny:llama", "--items", "2", "--ranks", "4", "--max-chunk-tokens", "10",
               "--image-grid", "2x2", "--arms", "patch,kvcapsule,recall", "--json", "--threads", "1"])
    assert rc == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    first, second = [i.id for i in probe_set(2)]
    failures = out["failures"]
    assert failures["kvcapsule-linear"]["items"] == [first] and "lu_solve" in failures["kvcapsule-linear"]["error"]
    assert failures["recall"]["n_failed"] == 2 and failures["recall"]["error"] == "ValueError: recall went wrong"
    assert out["arms"]["kvcapsule-linear"]["n"] == 1 and out["arms"]["patch-r4"]["n"] == 2
    assert "arm kvcapsule-linear failed on 1 of 2 items" in captured.err
