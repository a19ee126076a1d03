"""The safety-envelope study on a tiny random non-llama model (the figure in docs/ comes from
``python -m contextdeque.eval.fidelity.envelope``)."""

from __future__ import annotations

from contextdeque.eval.fidelity.envelope import rank_correlation, run_envelope
from contextdeque.eval.fidelity.probes import probe_set


def test_envelope_study_runs_and_orders_targets(tiny_backend_factory, one_thread):
    be = tiny_backend_factory("qwen2")
    s = run_envelope(be, probe_set(3), ranks=(2, 8), targets=(0.9, 0.99), max_chunk_tokens=48, image_grid=(3, 3))
    rows = {r["variant"]: r for r in s["variants"]}
    assert set(rows) == {"fixed-r2", "fixed-r8", "target-0.9", "target-0.99"}
    assert rows["target-0.99"]["patch_bytes"] >= rows["target-0.9"]["patch_bytes"]
    assert rows["fixed-r8"]["patch_bytes"] > rows["fixed-r2"]["patch_bytes"]
    assert rows["target-0.99"]["median_energy"] >= rows["target-0.9"]["median_energy"]
    assert s["items"] == 3 and "target_0.99" in s


def test_rank_correlation():
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert rank_correlation([1, 2], [1, 2]) is None


def test_envelope_leaves_out_items_past_the_trained_context(tiny_backend_factory, one_thread):
    be = tiny_backend_factory("qwen2")
    limit = be.layout.max_trained_position
    s = run_envelope(be, probe_set(2), ranks=(2,), targets=(0.9,), max_chunk_tokens=limit, image_grid=(3, 3))
    assert s["items_past_trained_context"] >= 1  # chunks of the whole context each cannot fit after the root
    assert s["items"] + s["items_past_trained_context"] <= 2
