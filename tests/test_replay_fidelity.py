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
                 "--jobs", "1", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["results"]) == 3 * 2
    for r in doc["results"]:
        assert r["fidelity_queries"] == 1
        assert r["kl"] >= 0 and r["ttft_ratio"] > 0
        assert r["eta"] is None or r["eta"] > 0  # the patch closes part of blind reuse's gap
    assert doc["fidelity"]["model"] == "SmolLM2-135M-Instruct"
