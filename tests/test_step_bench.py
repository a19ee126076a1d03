"""The per-step table of ``window-bench`` (``contextdeque.eval.step_bench``) on a tiny model: the
policies' rows describe the same windows, and after ``heal()`` the latency-first window answers
as the eager one does on every re-read; after an append it keeps its one forward's KV."""

from __future__ import annotations

import pytest
import torch
from helpers import micro_llama, seeded_ids

from contextdeque.eval.step_bench import STEPS, run_steps, window_step_ttft
from contextdeque.model.hf import HFBackend
from contextdeque.window.receipt import PREPARED_SERVED


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


@pytest.mark.parametrize("idle", [True, False], ids=["idle", "no-idle"])
def test_anticipation_rows_heal_to_the_eager_rows_under_the_same_settings(backend, idle):
    """The window's defaults (latency-first, anticipation on): every re-read step heals to the
    eager window with anticipation on too (``kl_vs_eager``, KL <= 1e-6), and with idle time before
    them the re-reads of the page that left and of a middle page (recall, look-back) run no forward
    and are served what idle time prepared or stored; without idle time nothing was prepared (what
    a miss costs, not healed)."""
    n_pages = 4
    pages = [seeded_ids(6, seed, vocab=60).tolist() for seed in range(n_pages + 2)]
    rows = run_steps(backend, pages, [50, 51, 52], policies=("eager+anticipate", "default"), rank=2,
                     n_pages=n_pages, idle=idle, heal_after=idle)
    by = {(r.policy, r.step): r for r in rows}
    for step in STEPS:
        row = by["default", step]
        assert row.idle == idle and (row.forwards == 0) == (step != "append"), step
        if not idle:
            assert row.kl_vs_eager is None and row.heal_forwards == 0
            continue
        if step != "append":  # (new content keeps its one forward's KV: see the test above)
            assert row.kl_vs_eager is not None and row.kl_vs_eager <= 1e-6, step
    if idle:
        for step in ("recall", "look-back"):
            row = by["default", step]
            assert row.deferred == 0 and set(row.served.split(",")) <= set(PREPARED_SERVED), step
    else:
        assert by["default", "recall"].deferred > 0


def test_oracles_are_computed_once_per_arrangement(backend):
    """The re-prefill references are shared: the same ids run one forward, whichever row asks;
    the time given is the median of the re-prefills of that length."""
    from contextdeque.eval.step_bench import Oracles

    oracles = Oracles(backend)
    a, b = seeded_ids(12, 1, vocab=60).tolist(), seeded_ids(12, 2, vocab=60).tolist()
    n0 = backend.forwards_run
    la, ms_a = oracles.reprefill(a)
    lb, ms_b = oracles.reprefill(b)
    la2, ms_a2 = oracles.reprefill(a)
    assert backend.forwards_run - n0 == 2 and la2 is la and not torch.equal(la, lb)
    assert ms_a2 == ms_b > 0  # (the median of the two samples of length 12)
    oracles.prefix_cache_ms(a, b)
    oracles.prefix_cache_ms(a, b)
    assert oracles.forwards == 3
    from contextdeque.eval.step_bench import StepRow

    early = StepRow(policy="p", step="s", forwards=0, step_ms=1.0, ttft_ms=1.0, reprefill_ms=ms_a, prefix_cache_ms=1.0,
                    kl_answer=0.0, kl_healed=0.0, heal_ms=0.0, heal_forwards=0, kl_vs_eager=None, deferred=0,
                    page_mb=0.0, floor_ms=0.0, tokens=12)
    oracles.reprefill(seeded_ids(12, 3, vocab=60).tolist())  # a third sample of that length
    oracles.settle([early])
    assert early.reprefill_ms == sorted(oracles._ms[12])[1]  # the median of all three


def test_window_step_ttft_rows(backend):
    """The window step (slide + recall + question) against a re-prefill, per policy: timed rows,
    and the eager window answers as the re-prefill does up to its patches' approximation."""
    pages = [seeded_ids(8, seed, vocab=60).tolist() for seed in range(5)]
    rows = window_step_ttft(backend, pages, [50, 51, 52], policies=("latency", "eager"), rank=2, repeats=2)
    assert [r["policy"] for r in rows] == ["latency", "eager"]
    for r in rows:
        assert r["window_tokens"] == 32 and r["page_tokens"] == 8 and r["repeats"] == 2
        assert 0 < r["step_ms"] <= r["ttft_ms"] and r["reprefill_ms"] > 0
        # the row's times are shown rounded, the ratio is taken before rounding
        assert r["ttft_vs_reprefill"] == pytest.approx(r["reprefill_ms"] / r["ttft_ms"], rel=1e-2, abs=2e-3)
        assert r["kl_answer_max"] >= 0.0


def test_bench_cli_json_on_cpu(capsys, one_thread):
    """``contextdeque bench --json`` end to end on a tiny model (tokenizer-less: text folded into
    its vocabulary), the window step included; no timing asserted."""
    import json

    from contextdeque.cli import main

    rc = main(["bench", "--model", "tiny", "--tokens", "128", "--rounds", "2", "--window-step-tokens", "32", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["device"] == "cpu" and out["ceilings"] is None
    row = out["by_dtype"]["bfloat16"]["128"]
    assert row["apply_s"] > 0 and row["bytes_moved"] > 0 and row["flops"] > 0
    assert row["true_floor_s"] is None and row["apply_device_s"] is None  # CUDA only
    assert [r["policy"] for r in out["window_step"]] == ["latency", "eager"]
    forming = out["forming"]["128"]  # the forward and the factorization, split; both routes on one Δ
    assert set(forming["factorize_s"]) == {"auto", "subspace", "eigh", "svd"}  # eigh on the host: CUDA only
    assert forming["form_patch_s"] > 0 and forming["forward_s"] > 0 and min(forming["factorize_s"].values()) > 0
    assert forming["svd_vs_auto"] == forming["factorize_s"]["svd"] / forming["factorize_s"]["auto"]
