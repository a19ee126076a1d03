"""Issue 21: every forward has a fixed cost a rate alone scales away (the H100's calibration: ~33 ms
per forward up to 1,024 tokens). The cost model charges it once per forward
(``CostModel.forward_fixed_s``, in ``prefill_s``), ``calibrate`` fits it as the intercept of the
prefill times, a calibration saved before it derives it at load, and an idle budget counted in
tokens charges it per forward (``WindowConfig.forward_fixed``, ``healing.IdlePrices``), the
window's and the replay's alike (the replay's equality: tests/test_replay_matches_window.py,
the ``per-forward`` idle cases)."""

from __future__ import annotations

import json

import pytest

from contextdeque.core.errors import ArgumentError
from contextdeque.scheduler.cost_model import CostModel, load_calibration, split_forward_fixed
from contextdeque.window import ContextWindow
from contextdeque.window.healing import HealBudget, IdlePrices, idle_spent
from contextdeque.window.plan import Encode, Form, Forward

from test_predictor import POOL, backend  # noqa: F401  (the tiny llama)

TABLE = ((100, 1000.0), (1000, 5000.0))  # a full prefill of 100 tokens: 0.1 s; of 1,000: 0.2 s


def test_prices_equal_a_hand_computation_from_a_small_table():
    """A forward of 200 tokens behind 300: 10 ms once, plus 200 x (1 / rate(500) - 10 ms / 500)."""
    cost = CostModel(prefill=TABLE, forward_fixed_s=0.010, form_fixed_s=0.002, svd_s_per_token=1e-6)
    rate_500 = 1000.0 + (5000.0 - 1000.0) * (500 - 100) / (1000 - 100)  # 2,777.8 tok/s, interpolated
    per_token = 1 / rate_500 - 0.010 / 500
    assert cost.per_token_s(500) == pytest.approx(per_token)
    assert cost.prefill_s(200, 300) == pytest.approx(0.010 + 200 * per_token)
    assert cost.seconds(Forward("b", 200, context=300)) == pytest.approx(0.010 + 200 * per_token)
    # a prefill of L tokens from scratch costs what the table measured
    for length in (100, 400, 1000):
        assert cost.prefill_s(length) == pytest.approx(length / cost.tokens_per_s(length))
    assert cost.seconds(Encode("b", 400)) == pytest.approx(400 / cost.tokens_per_s(400))
    # each of a Form's forwards pays the fixed part, its factorization is once
    two = cost.seconds(Form("b", 200, forwards=2, context=300))
    assert two == pytest.approx(2 * (0.010 + 200 * per_token) + 0.002 + 200e-6)
    # the case: the rate alone prices a short forward behind a long context at a fraction of it
    assert cost.prefill_s(8, 992) >= 0.010 > 8 / cost.tokens_per_s(1000)
    # the marginal rate prices a forward exactly at that length beside the fixed part
    assert 0.010 + 200 / cost.marginal_tokens_per_s(500) == pytest.approx(cost.prefill_s(200, 300))
    # no fixed part: the table's rate, as before
    plain = CostModel(prefill=TABLE)
    assert plain.prefill_s(200, 300) == pytest.approx(200 / rate_500)
    assert plain.marginal_tokens_per_s(500) == pytest.approx(rate_500)


def test_the_search_bound_stays_below_every_price_with_a_fixed_part():
    cost = CostModel(prefill=TABLE, forward_fixed_s=0.030, form_fixed_s=0.002, svd_s_per_token=1e-6)
    for tokens in (1, 8, 64, 500, 5000):
        assert cost.form_floor_s(tokens) >= 0.030
        assert all(cost.form_floor_s(tokens) <= cost.form_s(tokens, ctx) + 1e-12 for ctx in (0, 10, 300, 2000, 20000))


def test_a_fixed_part_that_leaves_no_time_per_token_has_no_marginal_rate():
    cost = CostModel(prefill=TABLE, forward_fixed_s=0.2)  # the whole 1,000-token prefill
    assert cost.per_token_s(1000) == 0.0 and cost.prefill_s(900, 100) == pytest.approx(0.2)
    with pytest.raises(ArgumentError, match="no time per token"):
        cost.marginal_tokens_per_s(1000)


@pytest.mark.parametrize(("fixed", "rate"), [(0.033, 60000.0), (0.0, 2000.0), (0.004, 1500.0)])
def test_the_fit_recovers_a_known_intercept(fixed, rate):
    """A table measured as ``fixed + n / rate`` for n tokens behind a 15-token root (its rows at
    root + n): the intercept comes back from the tokens measured."""
    lengths = (64, 256, 1024, 2048)
    table = tuple((15 + n, n / (fixed + n / rate)) for n in lengths)
    assert split_forward_fixed(table, lengths)[0] == pytest.approx(fixed, abs=1e-12)
    assert split_forward_fixed(table[:1], lengths[:1])[0] == 0.0  # one length: no line
    # never above the shortest measured time
    noisy = ((64, 64 / 0.030), (256, 256 / 0.020), (1024, 1024 / 0.021))
    assert 0.0 <= split_forward_fixed(noisy)[0] <= 0.020


def test_a_calibration_saved_before_it_derives_it_at_load(tmp_path):
    """The H100 file's own table: prefill 1,923 / 7,786 / 30,510 / 47,343 / 43,491 tok/s."""
    h100 = ((79, 1923.228215489156), (271, 7786.085808445031), (1039, 30509.979370306897), (2063, 47343.37658647251),
            (4111, 43491.36303045883))
    old = CostModel(prefill=h100, extra={"lengths": [64, 256, 1024, 2048, 4096]}).to_json()
    del old["forward_fixed_s"]
    p = tmp_path / "old.json"
    p.write_text(json.dumps(old))
    model, note = load_calibration(path=p)
    assert model.forward_fixed_s == pytest.approx(split_forward_fixed(h100, [64, 256, 1024, 2048, 4096])[0])
    assert 0.020 < model.forward_fixed_s < 0.033  # ~25 ms: the floor every forward pays there
    assert "derived" in note and "ms per forward" in note
    # a file that has it keeps it (and says nothing)
    p.write_text(json.dumps(CostModel(prefill=h100, forward_fixed_s=0.005).to_json()))
    model, note = load_calibration(path=p)
    assert model.forward_fixed_s == 0.005 and "derived" not in note


class _Clock:
    """``time`` for ``calibrate``: a nanosecond a reading; the tests add what an operation costs."""

    now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-9
        return self.now


def _on_a_synthetic_clock(tiny_backend_factory, monkeypatch):
    """``(calibrate module, tiny llama backend, clock)``: calibrate reads the clock, and every
    encode of n tokens costs 20 ms + n / 10,000 tok/s on it."""
    import contextdeque.replay.calibrate as calibrate_module

    clock = _Clock()
    monkeypatch.setattr(calibrate_module, "time", clock)
    be = tiny_backend_factory("llama")
    real_encode = be.encode

    def timed_encode(*args, **kwargs):
        out = real_encode(*args, **kwargs)
        clock.now += 0.020 + out.n_tokens / 10_000
        return out

    monkeypatch.setattr(be, "encode", timed_encode)
    return calibrate_module, be, clock


def test_calibrate_on_the_tiny_model_fits_a_known_synthetic_table(tmp_path, tiny_backend_factory, one_thread, monkeypatch):
    """``calibrate`` times each prefill with ``time.perf_counter``: on a clock where an encode of n
    tokens takes 20 ms + n / 10,000 tok/s (and anything else a microsecond), the saved
    ``forward_fixed_s`` is that 20 ms."""
    calibrate_module, be, _ = _on_a_synthetic_clock(tiny_backend_factory, monkeypatch)
    model = calibrate_module.calibrate(be, lengths=(16, 48, 96), rank=4, repeats=1, disk_dir=str(tmp_path),
                                       form_lengths=(16, 64))
    assert model.forward_fixed_s == pytest.approx(0.020, rel=1e-4)
    assert model.prefill_s(48, be.root_len) == pytest.approx(0.020 + 48 / 10_000, rel=1e-3)
    from contextdeque.cli.calibrate import forward_fixed_line

    assert "fixed part: 20.000 ms" in forward_fixed_line(model) and "48: 24.8 ms" in forward_fixed_line(model)


def test_an_idle_budget_charges_each_forward_its_fixed_part(backend):
    """``HealBudget.spend`` and ``idle_spent``: a forward's tokens plus ``forward_fixed`` per
    forward, beside the factorization charges; a window's heal under a token budget spends so."""
    budget = HealBudget(max_tokens=1000, prices=IdlePrices(0.5, 30.0, 40.0))
    budget.spend(100, factorized=80, patches=2, forwards=3)
    assert budget.tokens == pytest.approx(100 + 40.0 * 3 + 0.5 * 80 + 30.0 * 2)
    assert IdlePrices(0.5, 30.0, 40.0).charge(100, 3, 80, 2) == budget.tokens
    win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=False, forward_fixed=40.0)
    refs = [win.append(token_ids=p) for p in POOL[:3]]
    win.reorder([refs[2], refs[0], refs[1]])
    receipt = win.heal(max_tokens=10_000)
    assert receipt.forwards > 0
    assert idle_spent((receipt,), 0.0, 0.0, 40.0) == pytest.approx(receipt.tokens_prefilled + 40.0 * receipt.forwards)
    assert idle_spent((receipt,), 0.0) == receipt.tokens_prefilled  # (no per-forward charge: the tokens only)
    win.close()


def test_a_saved_window_keeps_its_per_forward_charge(tmp_path, backend):
    win = ContextWindow(backend, rank=2, forward_fixed=7.5)
    path = tmp_path / "w.cdq"
    win.save(path)
    assert ContextWindow.open(path, backend)._ctx.config.forward_fixed == 7.5


def test_replay_idle_rate_prices_forwards_from_the_calibration(tmp_path, monkeypatch, capsys):
    """``replay --idle-rate calibrated`` takes the marginal rate (a forward's time per token beyond
    its fixed part) and hands the window ``forward_fixed`` in those tokens at the replay's scale;
    the cost-model side gets it at scale 1."""
    import contextdeque.replay.fidelity as fidelity
    import contextdeque.replay.run as run
    from contextdeque.cli import main
    from contextdeque.scheduler.cost_model import save_calibration
    from contextdeque.traces import generate
    from contextdeque.traces.io import write_trace

    seen, replayed = {}, {}
    monkeypatch.setattr(fidelity, "run_fidelity_mode", lambda paths, combos, n, **kw: seen.update(kw) or {})
    real = run.replay_many
    monkeypatch.setattr(run, "replay_many", lambda *a, **kw: replayed.update(kw) or real(*a, **kw))
    cost = CostModel(prefill=TABLE, forward_fixed_s=0.010, form_fixed_s=0.002, svd_s_per_token=1e-6,
                     fingerprint="f" * 32, source="calibration")
    cal = save_calibration(cost, tmp_path)
    t = generate("doc", seed=0)
    trace = write_trace(tmp_path / "doc-0.jsonl", t.header, t.events)
    assert main(["replay", str(trace), "--arm", "patch", "--placement", "arrival", "--jobs", "1", "--fidelity", "1",
                 "--idle-rate", "calibrated", "--calibration", str(cal), "--json", "--ignore-hints"]) == 0
    capsys.readouterr()
    marginal = cost.marginal_tokens_per_s(fidelity.IDLE_CONTEXT)
    assert seen["idle_rate"] == pytest.approx(marginal) and marginal > cost.tokens_per_s(fidelity.IDLE_CONTEXT)
    assert seen["window_options"]["forward_fixed"] == pytest.approx(0.010 * marginal * fidelity.DEFAULT_SCALE)
    assert replayed["forward_fixed"] == pytest.approx(0.010 * marginal)
    assert replayed["factorization_fixed"] == pytest.approx(0.002 * marginal)
    assert seen["hints"] is False and replayed["hints"] is False  # --ignore-hints: both sides


def test_calibrate_splits_forming_beyond_the_forward_it_prices(tmp_path, tiny_backend_factory, one_thread, monkeypatch):
    """On a clock where every forward costs 20 ms + n / 10,000 tok/s and a patch's factorization 5 ms
    more, the cost model prices a Form at what ``form_patch`` took: the saved overhead is what it took
    beyond the forward the model prices (the table's per-token part behind the antecedent differs
    a little from this clock's, so the overhead is near, not at, 5 ms). (A difference of two
    encodes cancels the fixed 20 ms that ``form_patch``'s own forward pays, and saved 25 ms: the
    cost model charged the fixed part twice.)"""
    import contextdeque.patch as patch_module

    calibrate_module, be, clock = _on_a_synthetic_clock(tiny_backend_factory, monkeypatch)
    real_form = patch_module.form_patch

    def timed_form(backend, chunk, *args, **kwargs):
        out = real_form(backend, chunk, *args, **kwargs)
        clock.now += 0.020 + chunk.n_tokens / 10_000 + 0.005
        return out

    monkeypatch.setattr(patch_module, "form_patch", timed_form)
    model = calibrate_module.calibrate(be, lengths=(32, 256, 384), rank=4, repeats=1, disk_dir=str(tmp_path),
                                       form_lengths=(16, 64))
    ctx = be.root_len + calibrate_module.FORM_CONTEXT  # the table spans ctx + n: the price is interpolated
    for n in (16, 64):  # a Form priced as form_patch took (the split's line passes through both points)
        assert model.form_s(n, ctx) == pytest.approx(0.020 + n / 10_000 + 0.005, rel=5e-3)
    assert model.form_fixed_s < 0.010  # not the 25 ms a difference of encodes saved
