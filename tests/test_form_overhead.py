"""Issue 21: forming a patch beyond its forward costs a fixed part per patch (the factorization's
F x F eigenproblems, whatever the chunk's length) plus a per-token part. The cost model prices it
so (``CostModel.form_fixed_s``), ``calibrate`` fits both parts, and an idle budget charges both
(``WindowConfig.factorization_fixed`` beside ``factorization_cost``), the replay at its scale."""

from __future__ import annotations

import json

import pytest

from contextdeque.core.errors import ArgumentError
from contextdeque.scheduler.cost_model import CostModel, fit_fixed_and_slope, load_calibration
from contextdeque.window import ContextWindow
from contextdeque.window.healing import HealBudget, IdlePrices
from contextdeque.window.plan import Difference, Form

from test_predictor import backend  # noqa: F401  (the tiny llama)


@pytest.mark.parametrize(("fixed", "per_token"), [(0.035, 0.0), (0.0, 2e-5), (0.012, 3.5e-6)])
def test_the_fit_recovers_a_line_it_is_fed(fixed, per_token):
    for lengths in ((128, 512), (64, 256, 1024, 4096)):
        got = fit_fixed_and_slope([(t, fixed + per_token * t) for t in lengths])
        assert got == pytest.approx((fixed, per_token), rel=1e-9, abs=1e-15)


def test_the_fit_keeps_both_parts_non_negative():
    """Noise that tilts the line below zero costs the part that went negative, not the other's sign:
    a falling overhead is a fixed cost (the mean), one that crosses zero a per-token one."""
    assert fit_fixed_and_slope([(128, 0.040), (512, 0.030)]) == pytest.approx((0.035, 0.0))
    fixed, per_token = fit_fixed_and_slope([(128, 0.001), (512, 0.009)])  # the line's intercept: -0.00167
    assert fixed == 0.0 and per_token == pytest.approx((128 * 0.001 + 512 * 0.009) / (128 ** 2 + 512 ** 2))
    with pytest.raises(ArgumentError, match="two distinct"):
        fit_fixed_and_slope([(256, 0.01), (256, 0.02)])


def test_the_cost_model_charges_a_patch_its_fixed_part_once():
    cost = CostModel(form_fixed_s=0.035, svd_s_per_token=1e-6)
    assert cost.factorize_s(1024) == pytest.approx(0.035 + 1024e-6)
    assert cost.seconds(Difference("b", 64)) == pytest.approx(0.035 + 64e-6)
    one, two = (cost.seconds(Form("b", 512, forwards=n, context=300)) for n in (1, 2))
    assert two - one == pytest.approx(cost.prefill_s(512, 300))  # a second forward, not a second factorization
    assert cost.form_floor_s(512) <= cost.form_s(512, 300)


def test_a_calibration_saved_before_the_split_loads_with_no_fixed_part(tmp_path):
    old = CostModel(svd_s_per_token=3e-5).to_json()
    del old["form_fixed_s"]
    p = tmp_path / "old.json"
    p.write_text(json.dumps(old))
    model, _ = load_calibration(path=p)
    assert model.form_fixed_s == 0.0 and model.svd_s_per_token == 3e-5


def test_a_real_calibration_splits_the_forming_overhead(tmp_path, tiny_backend_factory, one_thread, capsys):
    from contextdeque.cli.calibrate import form_split_line
    from contextdeque.replay.calibrate import calibrate

    be = tiny_backend_factory("llama")
    model = calibrate(be, lengths=(16, 48), rank=4, repeats=1, disk_dir=str(tmp_path), form_lengths=(16, 64))
    assert model.form_fixed_s >= 0.0 and model.svd_s_per_token >= 0.0
    points = model.extra["form_overhead_s"]  # (timings on a shared CPU: their values are noise, not asserted)
    assert [t for t, _ in points] == [16, 64] and all(s >= 0.0 for _, s in points)
    assert (model.form_fixed_s, model.svd_s_per_token) == fit_fixed_and_slope(points)
    assert "per patch" in form_split_line(model) and "per token" in form_split_line(model)
    with pytest.raises(ArgumentError, match="form_lengths"):
        calibrate(be, lengths=(16,), form_lengths=(64,))


def test_a_heal_step_is_charged_per_patch_and_per_token():
    """``HealBudget.spend``: the forwards' tokens, ``factorization_fixed`` per patch and
    ``factorization_cost`` per factorized token (a window's heal: tests/test_predictor.py)."""
    budget = HealBudget(max_tokens=1000, prices=IdlePrices(factorization_cost=0.5, factorization_fixed=30.0))
    budget.spend(100, factorized=80, patches=2)
    assert budget.tokens == pytest.approx(100 + 0.5 * 80 + 30.0 * 2) and budget.allows_step()
    budget.spend(0, factorized=0, patches=27)
    assert not budget.allows_step()


def test_the_replay_scales_the_per_patch_charge_like_its_chunks():
    """At scale s the replay's chunks and idle budgets are s x the trace's, a patch still one patch:
    its fixed charge in real prefill tokens is s x too (a per-token charge, a ratio, is not)."""
    from contextdeque.replay.fidelity import IDLE_CONTEXT, factorization_cost, factorization_fixed

    cost = CostModel(form_fixed_s=0.035, svd_s_per_token=2e-6)
    rate = cost.tokens_per_s(IDLE_CONTEXT)
    assert factorization_fixed(cost, 1.0) == pytest.approx(0.035 * rate)
    assert factorization_fixed(cost, 1 / 16) == pytest.approx(0.035 * rate / 16)
    assert factorization_cost(cost) == pytest.approx(2e-6 * rate)
    assert factorization_fixed(CostModel()) == 0.0  # (no split calibrated: no per-patch charge)


def test_a_saved_window_keeps_its_per_patch_charge(tmp_path, backend):
    win = ContextWindow(backend, rank=2, factorization_cost=0.25, factorization_fixed=12.0)
    path = tmp_path / "w.cdq"
    win.save(path)
    again = ContextWindow.open(path, backend)
    assert again._ctx.config.factorization_fixed == 12.0 and again._ctx.config.factorization_cost == 0.25


def test_replay_idle_rate_sets_both_charges_from_the_calibration(tmp_path, monkeypatch, capsys):
    """``replay --fidelity N --idle-rate R`` passes the window both charges from the cost model,
    the per-patch one at the replay's scale (the fidelity run itself is stubbed: what is checked
    is what it is handed)."""
    import contextdeque.replay.fidelity as fidelity
    from contextdeque.cli import main
    from contextdeque.scheduler.cost_model import save_calibration
    from contextdeque.traces import generate
    from contextdeque.traces.io import write_trace

    seen = {}

    def fake_run(paths, combos, n, **kw):
        seen.update(kw["window_options"])
        return {}

    monkeypatch.setattr(fidelity, "run_fidelity_mode", fake_run)
    cost = CostModel(form_fixed_s=0.035, svd_s_per_token=2e-6, fingerprint="f" * 32, source="calibration")
    cal = save_calibration(cost, tmp_path)
    t = generate("doc", seed=0)
    trace = write_trace(tmp_path / "doc-0.jsonl", t.header, t.events)
    assert main(["replay", str(trace), "--arm", "patch", "--placement", "arrival", "--jobs", "1", "--fidelity", "1",
                 "--idle-rate", "1000", "--calibration", str(cal), "--json"]) == 0
    capsys.readouterr()
    assert seen["factorization_fixed"] > 0
    assert seen["factorization_fixed"] == pytest.approx(fidelity.factorization_fixed(cost, fidelity.DEFAULT_SCALE))
    assert seen["factorization_cost"] == pytest.approx(fidelity.factorization_cost(cost))
