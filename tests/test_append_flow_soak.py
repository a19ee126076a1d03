"""The append-only flow's forward counts (vs a prefix cache) and a short soak on the default
bounded store: the measurements ``window-bench --append-only`` and ``contextdeque soak`` report."""

from __future__ import annotations

import pytest
from helpers import micro_llama, seeded_ids

from contextdeque.eval.append_flow import run_append_flow
from contextdeque.eval.soak import run_soak
from contextdeque.model.hf import HFBackend
from contextdeque.window import WindowConfig


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    return HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-flow-llama")


def test_append_only_forwards_per_policy(backend, one_thread):
    chunks = [seeded_ids(6, 50 + i, vocab=60).tolist() for i in range(8)]
    rows = {r.policy: r for r in run_append_flow(backend, chunks, policies=("eager", "latency"), rank=4)}
    assert all(r.prefix_forwards_per_append == 1 for r in rows.values())
    # latency-first: one conditioned forward per append, what the prefix cache runs
    assert rows["latency"].forwards_per_append == 1 and rows["latency"].forward_ratio == 1
    # eager: the canonical's encode plus the patch's conditioned forward
    assert rows["eager"].forwards_per_append == 2 and rows["eager"].first_forwards == 1


def test_short_soak_stays_within_the_memory_budget(backend, tmp_path, one_thread):
    budget = 64 * 1024
    r = run_soak(backend, ops=120, config=WindowConfig(budget_tokens=40), section_tokens=8, memory_budget=budget,
                 store_dir=str(tmp_path / "d"), sample_every=20, seed=3)
    assert r["ops"] == 120 and r["errors"] == {}, r["errors"]
    assert set(r["op_counts"]) >= {"append", "recall", "evict"}
    for row in r["curve"]:
        assert row["store"]["device"] + row["store"]["host"] <= budget
    assert r["curve"][-1]["store"]["disk"] > 0 and r["evicted_refs"] > 0
