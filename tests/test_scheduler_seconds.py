"""The placement scheduler priced by the cost model (``SECONDS_WEIGHTS``: the replay's own price
list, seconds per planned operation): its exact search still equals brute force, an order is
priced as the cost model prices the window's plan for it, and on replay-bench's generated sets
(four traces per kind, no budget) it costs no more estimated seconds than the forms pricing."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from contextdeque.replay import Replayer
from contextdeque.scheduler import FORMS_WEIGHTS, SECONDS_WEIGHTS, PatchGraph, SchedulerPlacement, brute_force, exact, order_cost
from contextdeque.scheduler.cost import Scorer
from contextdeque.scheduler.cost_model import DEFAULTS, CostModel
from contextdeque.traces import generate
from contextdeque.window.placement import PlacementView
from contextdeque.window.plan import Form

from test_scheduler import _random_view


@pytest.mark.parametrize("seed", range(60))
def test_exact_search_equals_brute_force_in_seconds(seed):
    """The search's bound (each form at the chunk's fastest, ``CostModel.form_floor_s``) stays a
    lower bound in seconds: branch-and-bound finds the brute-force minimum."""
    rng = random.Random(seed)
    view, entering = _random_view(rng, rng.randint(1, 5), rng.randint(1, 2))
    for w in (SECONDS_WEIGHTS, replace(SECONDS_WEIGHTS, diverge=0.0)):
        _, c_bf = brute_force(view, entering, w)
        _, c_ex = exact(view, entering, w)
        assert c_ex == pytest.approx(c_bf, rel=1e-9, abs=1e-12)


def test_the_floor_is_below_every_form():
    cost = DEFAULTS
    for tokens in (1, 16, 300, 5000):
        assert all(cost.form_floor_s(tokens) <= cost.form_s(tokens, ctx) for ctx in (0, 100, 700, 3000, 20000))


def test_an_order_is_priced_as_the_cost_model_prices_its_plan():
    """X forms behind A and B: the cost model's seconds of that form (its conditioned forward
    behind 200 tokens and the factorization); C keeps its patch behind X, paying its staleness in
    shares of the decision's typical form. A calibrated (slower) cost model prices it higher."""
    tokens = {"A": 100, "B": 100, "C": 100, "X": 400}
    content = {k: k for k in tokens}
    g = PatchGraph()
    view = PlacementView(order=["A", "B", "C"], tokens=tokens, content=content,
                         formed_on={"A": (), "B": ("A",), "C": ("A", "B")}, has_patch=g.has_patch,
                         stored_prefixes=g.stored_prefixes, may_hit=g.may_hit)
    w = replace(SECONDS_WEIGHTS, diverge=0.0)
    kept = order_cost(view, ["A", "B", "X", "C"], frozenset("X"), w)
    form_x = DEFAULTS.seconds(Form("X", 400, context=200))
    unit = Scorer(view, frozenset("X"), w).unit_s()
    assert unit == pytest.approx(DEFAULTS.form_s(175, 350))  # mean 175 tokens behind half of 700
    assert kept.forms == 1 and kept.stale > 0
    assert kept.total == pytest.approx(form_x + (w.stale * kept.stale + w.move) * unit)
    slow = replace(w, cost=CostModel(prefill=((128, 150.0), (8192, 50.0))))
    assert order_cost(view, ["A", "B", "X", "C"], frozenset("X"), slow).total > 5 * kept.total
    # the forms pricing counts the same plan in forms
    forms = order_cost(view, ["A", "B", "X", "C"], frozenset("X"), replace(FORMS_WEIGHTS, diverge=0.0))
    assert forms.total == pytest.approx(1 + forms.stale + FORMS_WEIGHTS.move)


@pytest.mark.parametrize("kind", ["web", "video", "doc"])
def test_seconds_pricing_costs_no_more_than_the_forms_pricing(kind):
    """replay-bench's scheduler rows (four generated traces per kind, no budget): the scheduler and
    the offline scheduler priced in seconds cost no more estimated seconds than priced in forms
    (measured: web 898.9 = 898.9, video 264.9 < 265.2, doc 822.4 < 824.6; offline 898.9 = 898.9,
    266.7 < 267.1, 833.2 = 833.2)."""
    traces = [generate(kind, seed=s) for s in range(4)]
    for offline in (False, True):
        total = {}
        for name, w in (("forms", FORMS_WEIGHTS), ("seconds", SECONDS_WEIGHTS)):
            total[name] = sum(Replayer(t, SchedulerPlacement(weights=w, offline=offline), "lru", "patch").run().est_seconds
                              for t in traces)
        assert total["seconds"] <= total["forms"] + 1e-6, (offline, total)
