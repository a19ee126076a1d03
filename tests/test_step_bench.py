"""The per-step table of ``window-bench`` (``contextdeque.eval.step_bench``) on a tiny model: the
policies' rows describe the same windows, and after ``heal()`` the latency-first window answers
as the eager one does on every re-read; after an append it keeps its one forward's KV."""

from __future__ import annotations

import pytest
from helpers import micro_llama, seeded_ids

from contextdeque.eval.step_bench import STEPS, run_steps
from contextdeque.model.hf import HFBackend


@pytest.fixture(scope="module")
def backend(one_thread):
    return HFBackend(micro_llama(11), None, root_ids=[1, 3], name="tiny-step-bench-llama")


def test_latency_rows_heal_to_the_eager_rows(backend):
    n_pages = 4
    pages = [seeded_ids(6, seed, vocab=60).tolist() for seed in range(n_pages + 2)]
    rows = run_steps(backend, pages, [50, 51, 52], policies=("latency", "eager"), rank=2, n_pages=n_pages)
    by = {(r.policy, r.step): r for r in rows}
    assert set(by) == {(p, s) for p in ("eager", "latency") for s in STEPS}
    for step in STEPS:
        eager, latency = by["eager", step], by["latency", step]
        assert eager.kl_vs_eager == 0.0 and eager.heal_forwards == 0
        if step == "append":  # new content: one forward after the window, like a prefix cache, and
            # nothing more: its KV is exact where it stands (the eager window's is canonical + patch)
            # (exact given the window's KV; that window is the same stale one for both policies, so
            # neither is the re-prefill: test_latency checks the exactness on an unbudgeted window)
            assert latency.forwards == 1 and eager.forwards == 2 and latency.heal_forwards == 0
            assert latency.kl_healed == latency.kl_answer  # healing had nothing to change
            continue
        # a re-read of stored content: healed, the latency window is the eager window
        assert latency.kl_vs_eager is not None and latency.kl_vs_eager <= 1e-6, step
        assert abs(latency.kl_healed - eager.kl_healed) <= 1e-6, step
        # nothing on the critical path, the eager policy's forming work when healing
        assert latency.forwards == 0 and latency.heal_forwards == eager.forwards, step
