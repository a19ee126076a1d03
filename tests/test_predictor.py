"""Recall predictors (window.predictor) and the replay's anticipation hit rate (replay.hits): the
predictor ranks what the agent said first and learns groups from the session's own steps; the
idle budget is deterministic (tokens, not wall time); the hit rate is read off the receipts —
a trace whose recalls follow idle time gets them fresh, the same trace with no idle gets none."""

from __future__ import annotations

import pytest
from helpers import POOL, micro_llama

from contextdeque.core.errors import WindowError, WindowTypeError
from contextdeque.model.hf import HFBackend
from contextdeque.replay.hits import HitRate
from contextdeque.replay.live import drive_window
from contextdeque.traces import TraceBuilder, TraceHeader, idle_gaps
from contextdeque.window import RECALL_PREDICTORS, ContextWindow, Prediction, RecallPredictor
from contextdeque.window.anticipation import recall_candidates
from contextdeque.window.config import WindowConfig
from contextdeque.window.predictor import rank_predictions

PAGES = {"task": [5, 6, 7], "a": [10, 11, 12, 13], "b": [20, 21, 22, 23, 24], "c": [30, 31, 32], "d": [40, 41, 42, 43]}


@pytest.fixture(scope="module")
def backend(one_thread):
    return HFBackend(micro_llama(11), None, root_ids=[1, 3], name="tiny-predictor-llama")


def window(backend, predictor="session", **kw):
    win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=True, recall_predictor=predictor, **kw)
    refs = {name: win.append(chunk=backend.encode(token_ids=ids)) for name, ids in PAGES.items()}
    win.heal()
    return win, refs


@pytest.mark.parametrize("predictor", sorted(RECALL_PREDICTORS))
def test_an_expected_chunk_ranks_first(backend, predictor):
    win, refs = window(backend, predictor)
    for name in ("a", "b", "c"):
        win.evict(refs[name])
    top = recall_candidates(win, win._state)[0]
    if predictor == "recency":  # no hint: the latest to leave
        assert top.recalls == ((refs["c"], None),)
    else:  # no hint: they left together, the group comes back together (end: the prior's favourite)
        assert top.recalls[:2] == ((refs["a"], "end"), (refs["b"], "end")) and top.source == "group"
    win.expect(refs["a"], at=1)
    top = recall_candidates(win, win._state)[0]
    assert top.recalls == ((refs["a"], 1),) and top.source == "expected"


def test_session_predictor_learns_groups_and_prepares_the_whole_chain(backend):
    """Pages that leave together come back together: after one such round trip the predictor
    ranks the group's chain first, and anticipation prepares every recall of it (0 forwards)."""
    win, refs = window(backend)
    for name in ("a", "b"):  # one eviction run: a group
        win.evict(refs[name])
    for name in ("a", "b"):
        win.recall(refs[name], at="end")
    predictor = win.recall_predictor
    assert predictor.follows == 1 and predictor.p_follow > 0.5 and predictor.where["end"] == 2
    win.heal()
    win.evict(refs["c"])
    win.evict(refs["task"])  # a run of two: c, task
    win.append(chunk=backend.encode(token_ids=[50, 51]))  # ends the run
    win.evict(refs["d"])  # a group of its own, the latest to leave
    ranked = recall_candidates(win, win._state)
    chains = [p.recalls for p in ranked if len(p.recalls) > 1]
    assert chains and chains[0] == ((refs["c"], "end"), (refs["task"], "end"))
    win.heal(max_tokens=10_000)
    for name in ("c", "task"):
        r = win.recall(refs[name], at="end")
        assert r.forwards == 0 and r.answered_fresh and {w for _, w in r.served} == {"anticipated"}


def test_predictions_are_priced_and_ranked_by_benefit_per_token():
    from contextdeque.window.ref import new_ref

    x, y = new_ref("x", 10), new_ref("y", 100)
    cheap = Prediction(((x, None),), 0.5, cost_tokens=10, saved_tokens=10)
    dear = Prediction(((y, None),), 0.6, cost_tokens=200, saved_tokens=100)  # owes its canonical too
    assert cheap.ratio == pytest.approx(0.5) and dear.benefit == pytest.approx(60)
    assert [p.recalls[0][0] for p in rank_predictions([dear, cheap, dear])] == [x, y]  # one copy each


def test_a_predictor_is_one_registered_class(backend):
    class LastOnly(RecallPredictor):
        name = "test-last-only"

        def predict(self, state, expected):
            return [Prediction(((next(reversed(state.evicted)), 0),), 1.0, 1, 1)] if state.evicted else []

    try:
        win, refs = window(backend, "test-last-only")
        win.evict(refs["b"])
        assert [p.recalls for p in recall_candidates(win, win._state)] == [((refs["b"], 0),)]
        win.heal()
        assert win.recall(refs["b"], at=0).answered_fresh
        with pytest.raises(WindowError, match="unknown recall predictor"):
            WindowConfig(recall_predictor="nope")
        with pytest.raises(WindowTypeError):
            WindowConfig(recall_predictor=3)
    finally:
        del RECALL_PREDICTORS["test-last-only"]


def test_the_idle_budget_is_tokens_and_deterministic(backend):
    """heal(max_tokens=0) forms nothing; a budget is never overspent by anticipation (a prediction
    that does not fit is skipped); the same steps under the same budget form the same work."""
    def run(budget):
        win, refs = window(backend)
        for name in ("a", "b", "c"):
            win.evict(refs[name])
        r = win.heal(max_tokens=budget)
        names = {ref: name for name, ref in refs.items()}
        return r, (r.tokens_prefilled, r.forwards, [names[x] for x in r.refs])

    none, _ = run(0)
    assert none.forwards == 0 and none.tokens_prefilled == 0
    full, _ = run(None)
    assert full.tokens_prefilled > 0
    small = full.tokens_prefilled - 1
    ra, a = run(small)
    _, b = run(small)
    assert 0 < ra.tokens_prefilled <= small
    assert a == b


@pytest.mark.parametrize("charge", [{"factorization_cost": 1.0}, {"factorization_fixed": 10.0}], ids=["per-token", "per-patch"])
def test_the_idle_budget_charges_the_factorization(backend, charge):
    """With ``factorization_cost`` (per token) or ``factorization_fixed`` (per patch: issue 21's
    fixed part) a forming costs the budget its forward and its factorization (the honest budget):
    the budget that paid the forwards of a whole anticipation uncharged pays less of it charged,
    and what it spent, factorizations included, stays within the budget."""
    from contextdeque.window.healing import idle_spent
    from contextdeque.window.plan import Difference, Form

    def run(budget, **charged):
        win, refs = window(backend, **charged)
        for name in ("a", "b", "c"):
            win.evict(refs[name])
        return win.heal(max_tokens=budget)

    def spent(receipt):
        return idle_spent([receipt], charge.get("factorization_cost", 0.0), charge.get("factorization_fixed", 0.0))

    free = run(None)
    sizes = [op.tokens for op in free.plan if isinstance(op, (Form, Difference))]
    assert free.tokens_prefilled > 0 and sizes  # (patches factorized)
    assert spent(free) == free.tokens_prefilled + charge.get("factorization_cost", 0.0) * sum(sizes) + charge.get(
        "factorization_fixed", 0.0) * len(sizes)
    honest = run(free.tokens_prefilled, **charge)
    assert spent(honest) <= free.tokens_prefilled
    assert honest.tokens_prefilled < free.tokens_prefilled
    (name,) = charge
    with pytest.raises(WindowError, match=name):
        WindowConfig(**{name: -1.0})


def four_chunk_trace() -> TraceBuilder:
    """The opening of the traces below: task, a, b, c arrive and the agent asks."""
    b = TraceBuilder(TraceHeader(generator="test"))
    b.step(t=0.0, idle=0.0)
    for name in ("task", "a", "b", "c"):
        b.arrive(name, len(PAGES[name]), name)
    b.query(4, 1)
    return b


def recall_trace(idle: float):
    """task, a, b, c arrive; c leaves; idle; c comes back (a recall at the end: nothing depends on
    it); then a leaves; idle; a comes back in front (a look-back: b and c were conditioned on it)."""
    b = four_chunk_trace()
    b.evict("c")
    b.step(idle=idle)
    b.recall("c")
    b.query(4, 1)
    b.evict("a")
    b.step(idle=idle)
    b.recall("a", at=0)
    b.query(4, 1)
    return b.build(name=f"recalls-{idle}")


@pytest.mark.parametrize("idle", [0.0, 1000.0])
def test_hit_rate_from_receipts(backend, idle):
    trace = recall_trace(idle)
    assert sorted(set(idle_gaps(trace).values())) == sorted({0.0, idle})
    win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=True)
    hits = HitRate()
    steps = []
    drive_window(win, trace, lambda ev: PAGES[ev.id], on_step=lambda s, r: (steps.append(s), hits.add(s, r)),
                 idle_tokens=lambda ms: int(ms))  # 1 token per idle ms
    assert steps == ["append"] * 4 + ["evict", "recall", "evict", "look-back"]
    by = hits.by_step()
    assert by["recall"]["steps"] == by["look-back"]["steps"] == 1 and by["evict"]["steps"] == 2
    if idle:  # anticipated: both re-reads fresh, the look-back's cascade (b, c) included
        assert hits.rate() == 1.0 and hits.rate(own=True) == 1.0
    else:  # nothing prepared: served blind, deferred
        assert hits.rate() == 0.0 and hits.rate(own=True) == 0.0
    assert hits.as_dict()["re_reads"] == 2


def test_unpinned_recalls_go_where_the_windows_recall_placement_puts_them(backend):
    """drive_window(pin_recalls=False): a recall the trace does not place is recall(ref) (the
    window's recall placement: where a stored patch stays valid), not the end (issue 21, item 2)."""
    b = four_chunk_trace()
    b.evict("a")
    b.step(idle=0.0)
    b.recall("a")
    b.query(4, 1)
    trace = b.build(name="unpinned")
    placed = {}
    for pinned in (True, False):
        win = ContextWindow(backend, rank=2, anticipate=True)
        drive_window(win, trace, lambda ev: PAGES[ev.id], pin_recalls=pinned,
                     on_step=lambda s, r, pinned=pinned: placed.__setitem__(pinned, r.placed) if s != "append" and r.placed else None)
    (_, at_pinned, why_pinned), = placed[True]
    (_, at_free, why_free), = placed[False]
    assert (at_pinned, why_pinned) == (3, "asked")  # the end, as the trace prices it
    assert why_free != "asked"  # the window chose (and says why)


@pytest.mark.parametrize("argv, message", [
    (["--idle-rate", "fast", "--fidelity", "1"], "--idle-rate: expected tokens per second"),
    (["--idle-rate", "1000"], "--idle-rate needs --fidelity"),
])
def test_replay_cli_refuses_a_bad_idle_rate_before_any_work(tmp_path, capsys, argv, message):
    from contextdeque.cli import main
    from contextdeque.traces import write_trace

    trace = recall_trace(10.0)
    path = write_trace(tmp_path / "t.jsonl", trace.header, trace.events)
    assert main(["replay", str(path), "--jobs", "1", *argv]) == 1
    assert message in capsys.readouterr().err


def test_replay_cli_prices_the_idle_gaps_it_drives_the_window_through(tmp_path, capsys, monkeypatch):
    """``replay --fidelity N --idle-rate R``: the cost-model side of the report heals within the
    same idle budget per step as the driven window (R x the gap, in the trace's own tokens, with
    the factorization charge and anticipation), not to completion at every step (issue 22 (b))."""
    import json

    import contextdeque.replay.fidelity as fidelity
    from contextdeque.cli import main
    from contextdeque.replay import ReplayConfig, Replayer
    from contextdeque.replay.live import idle_budget
    from contextdeque.scheduler.cost_model import load_calibration
    from contextdeque.traces import write_trace

    monkeypatch.setattr(fidelity, "run_fidelity_mode", lambda *a, **k: {})  # (the live side: not this test's)
    trace = recall_trace(10.0)
    path = write_trace(tmp_path / "t.jsonl", trace.header, trace.events)
    argv = ["replay", str(path), "--jobs", "1", "--policies", "arrival:lru:patch", "--patch-policy", "latency", "--json"]
    assert main([*argv, "--fidelity", "1", "--idle-rate", "1000"]) == 0
    (got,) = json.loads(capsys.readouterr().out)["results"]
    cost, _ = load_calibration()
    config = ReplayConfig(anticipate=True)
    budgeted = Replayer(trace, "arrival", "lru", "patch-latency", cost, config, idle_tokens=idle_budget(1000.0),
                        factorization_cost=fidelity.factorization_cost(cost)).run().as_dict()
    unbounded = Replayer(trace, "arrival", "lru", "patch-latency", cost, config).run().as_dict()
    keys = ("tokens_prefilled", "forwards", "patch_forms", "heal_tokens")
    assert {k: got[k] for k in keys} == {k: budgeted[k] for k in keys}
    assert got["tokens_prefilled"] < unbounded["tokens_prefilled"]  # 10 ms at 1,000 tokens/s: not everything


def old_recall_trace(hint: bool):
    """Two groups leave (a, then c); after an idle that affords one prediction the agent recalls
    the older one, a: only the agent's hint makes it the one prepared."""
    b = TraceBuilder(TraceHeader(generator="test"))
    for name in ("task", "a", "b", "c"):
        b.arrive(name, len(PAGES[name]), name)
    b.evict("a")
    b.query(4, 1)
    b.evict("c")
    if hint:
        b.expect("a")
    b.step(idle=18.0)  # after the queued heal and the slide's canonical: a (8 tokens) or c (6), not both
    b.recall("a")
    return b.build(name=f"old-recall-{hint}")


def test_an_expect_event_steers_a_small_idle_budget(backend):
    from contextdeque.core.errors import UnknownChunkError
    from contextdeque.traces import Expect, trace_from_events

    for hint, fresh in ((True, 1.0), (False, 0.0)):
        trace = old_recall_trace(hint)
        assert sum(e.op == "expect" for e in trace.events) == int(hint)
        win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=True)
        hits = HitRate()
        drive_window(win, trace, lambda ev: PAGES[ev.id], on_step=hits.add, idle_tokens=lambda ms: int(ms))
        assert hits.rate(["recall"]) == fresh
    with pytest.raises(UnknownChunkError, match="never arrived"):
        trace_from_events(TraceHeader(generator="test"), [Expect(id="ghost")])


def test_ignoring_hints_drops_them_on_the_replay_side_too():
    """``replay --ignore-hints`` (``Replayer(hints=False)``, as ``drive_window(hints=False)``): the
    cost-model side skips the trace's ``expect`` events, so a hinted trace replays as the same trace
    without them (before: the replay read them anyway, the live side did not)."""
    from contextdeque.replay import ReplayConfig, Replayer

    def replayed(trace, hints):
        return Replayer(trace, "arrival", "lru", "patch-latency", config=ReplayConfig(anticipate=True),
                        idle_tokens=lambda ms: int(ms), hints=hints).run().as_dict()

    keys = ("tokens_prefilled", "forwards", "patch_forms", "patch_hits", "heal_tokens")
    ignored, unhinted = replayed(old_recall_trace(True), False), replayed(old_recall_trace(False), True)
    assert {k: ignored[k] for k in keys} == {k: unhinted[k] for k in keys}
    hinted = replayed(old_recall_trace(True), True)
    assert {k: hinted[k] for k in keys} != {k: ignored[k] for k in keys}  # (the hint changes what is prepared)


def test_session_predictor_memory_is_bounded_by_the_evicted_set(backend, monkeypatch):
    from contextdeque.window import predictor_session

    monkeypatch.setattr(predictor_session, "REMEMBERED", 2)
    win, refs = window(backend)
    for name in ("a", "b", "c"):
        win.evict(refs[name])
    win.recall(refs["a"])
    win.recall(refs["b"])
    win.evict(refs["d"])  # over the bound: only the refs still evicted are remembered
    assert set(win.recall_predictor.group_of) == {refs["c"], refs["d"]}


def test_an_eviction_after_a_slide_of_nothing_starts_its_group(backend):
    """A slide that lets nothing go is an evicting step with no group; the eviction after it
    (the same run) starts one (found by the window state machine: KeyError before)."""
    win, refs = window(backend)
    win.slide(0)
    win.evict(refs["b"])
    predictor = win.recall_predictor
    assert predictor.group_of[refs["b"]] in predictor.members
    assert predictor.members[predictor.group_of[refs["b"]]] == [refs["b"]]


def test_a_recall_fulfils_its_hint(backend):
    """A hint names the next re-read: once recalled, the chunk leaves the hints (a group's later
    members stay, one index on), so when it leaves again it does not head the hinted chain."""
    win, refs = window(backend)
    for name in ("a", "b", "c"):
        win.evict(refs[name])
    win.expect([refs["a"], refs["c"]], at=1)
    win.expect(refs["b"])
    win.recall(refs["a"], at=1)
    assert win.expected == {(refs["c"],): 2, (refs["b"],): None}
    win.recall(refs["b"], at="end")
    win.evict(refs["a"])  # a leaves again: its old hint says nothing about it now
    assert win.expected == {(refs["c"],): 2}
    assert recall_candidates(win, win._state)[0].recalls == ((refs["c"], 2),)


def test_a_budget_too_small_for_the_hinted_chain_prepares_its_first_recalls(backend):
    """The hints are one chain; a budget that cannot hold it prepares its longest prefix that fits
    (the recalls that come first, in the arrangement the chain leaves), not the later hints alone
    (each alone is another arrangement, useless to the chain)."""
    from contextdeque.window.placement import END
    from contextdeque.window.predictor import chain_tokens

    win, refs = window(backend)
    for name in ("a", "b", "c"):
        win.evict(refs[name])
    for name in ("a", "b", "c"):
        win.expect(refs[name], at="end")
    first_two, _ = chain_tokens(win._state, [(refs["a"], END), (refs["b"], END)])
    whole, _ = chain_tokens(win._state, [(refs[n], END) for n in ("a", "b", "c")])
    assert first_two < whole
    win.heal(max_tokens=first_two)
    assert [win.recall(refs[n], at="end").answered_fresh for n in ("a", "b", "c")] == [True, True, False]


def reaccess_trace(order_hint: bool):
    """task, a, b, c arrive; a and b leave; the agent announces their recall and the reorder it
    then runs (a and b next to the task); idle; they come back and the window is reordered."""
    b = four_chunk_trace()
    b.evict("a")
    b.evict("b")
    b.expect("a")
    b.expect("b")
    if order_hint:
        b.expect_order(["task", "a", "b", "c"])
    b.step(idle=1000.0)
    b.recall("a")
    b.recall("b")
    b.reorder(["task", "a", "b", "c"])
    b.query(4, 1)
    return b.build(name=f"reaccess-{order_hint}")


@pytest.mark.parametrize("order_hint", [True, False])
def test_an_announced_reorder_after_the_recalls_is_prepared_with_them(backend, order_hint):
    """An ``expect`` event with an order: the window prepares the hinted recalls, then that reorder
    on the arrangement they leave (one prediction); the reorder runs no forward. Without the
    order, the recalls are still fresh and the reorder is not."""
    trace = reaccess_trace(order_hint)
    win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=True)
    hits = HitRate()
    drive_window(win, trace, lambda ev: PAGES[ev.id], on_step=hits.add, idle_tokens=lambda ms: int(ms))
    by = hits.by_step()
    assert by["recall"]["hits"] == 2
    assert by["reorder"]["hits"] == int(order_hint)


@pytest.mark.parametrize("cascade_policy", ["reform", "keep", "flag"])
def test_a_prediction_prices_the_cascade_only_where_the_window_re_forms_it(backend, cascade_policy):
    """A recall's dependents cost forming only under ``cascade_policy="reform"``; a window that keeps
    them as they are (``keep``, ``flag``) prices the recalled chunk's own forming alone, so a budget
    that holds it prepares it."""
    from contextdeque.window.anticipation import recall_candidates

    win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=True, cascade_policy=cascade_policy)
    refs = [win.append(token_ids=p) for p in POOL[:4]]  # each conditioned on the ones before it
    win.heal(anticipate=False)
    win.evict(refs[1])
    win.expect(refs[1], at=1)
    (top,) = [p for p in recall_candidates(win, win._state) if p.recalls == ((refs[1], 1),)]
    own = len(POOL[1]) * (2 if win._state.evicted[refs[1]].owes_encode else 1)  # its forward (and canonical owed)
    dependents = len(POOL[2]) + len(POOL[3])
    assert top.cost_tokens == own + (dependents if cascade_policy == "reform" else 0)
    win.close()
