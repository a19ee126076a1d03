"""``replay --fidelity`` end to end on the embedded default model: a short generated trace of each
agent kind, KL / η / TTFT ratio in the JSON."""

from __future__ import annotations

import json

import pytest

from contextdeque.cli import main
from contextdeque.traces import generate, write_trace


@pytest.mark.slow
def test_replay_fidelity_on_the_default_model(default_backend, tmp_path, capsys):
    traces = [generate("web", seed=0, steps=3), generate("video", seed=0, segments=3),
              generate("doc", seed=0, pages=4, select=2, rounds=1)]
    paths = [str(write_trace(tmp_path / f"{t.name}.jsonl", t.header, t.events)) for t in traces]
    code = main(["replay", *paths, "--placement", "arrival,scheduler", "--arm", "patch", "--fidelity", "1",
                 "--patch-policy", "eager",
                 "--jobs", "1", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["results"]) == 3 * 2
    for r in doc["results"]:
        assert r["fidelity_queries"] == 1
        assert r["kl"] >= 0 and r["ttft_ratio"] > 0
        assert r["eta"] is None or r["eta"] > 0  # the patch closes part of blind reuse's gap
    assert doc["fidelity"]["model"] == "SmolLM2-135M-Instruct"


def test_fidelity_per_step_type_and_after_heal(tiny_backend_factory):
    """Per step type figures; a latency-first window that answered with queued work heals to a
    re-prefill under full rank (``latency:exact``), and the eager exact policy needs no healing."""
    from contextdeque.replay.fidelity import fidelity_run
    from contextdeque.traces import generate

    backend = tiny_backend_factory("llama", seed=3)
    trace = generate("video", seed=1, segments=5)  # evictions and look-backs, not only appends
    n_queries = sum(e.op == "query" for e in trace.events)
    lat = fidelity_run(backend, trace, "arrival", "patch", n_queries, patch_policy="latency:exact", scale=1 / 64)
    assert lat["fidelity_queries"] == n_queries and len(lat["kl_by_step"]) >= 2
    assert set(lat["kl_healed_by_step"]) <= set(lat["kl_by_step"])
    assert lat["kl_healed_by_step"], "a latency-first window should have had queued work at some query"
    assert max(lat["kl_healed_by_step"].values()) <= 1e-4
    eager = fidelity_run(backend, trace, "arrival", "patch", n_queries, patch_policy="exact", scale=1 / 64)
    assert eager["kl_healed_by_step"] == {}  # nothing queued: the eager policy formed everything in line
    assert max(eager["kl_by_step"].values()) <= 1e-4
