"""What idle-time anticipation forms that no step uses (replay.idle_use), and anticipation's price
floor (``MIN_SAVED_PER_FORMED``): predictions with ~0 expected use are not formed, and on an
agent's trace that cuts the idle forwards without losing a hit."""

from __future__ import annotations

import pytest
from helpers import micro_llama

import contextdeque.window.anticipate_reorder as anticipate_reorder
import contextdeque.window.anticipation as anticipation
from contextdeque.model.hf import HFBackend
from contextdeque.replay.idle_use import idle_use, idle_use_table
from contextdeque.traces import generate
from contextdeque.window import Prediction, RecallPredictor
from contextdeque.window.anticipate_reorder import MIN_SAVED_PER_FORMED
from contextdeque.window.anticipation import plan_recalls
from contextdeque.window.ref import ChunkRef


@pytest.fixture(scope="module")
def backend(one_thread):
    return HFBackend(micro_llama(11), None, root_ids=[1, 3], name="tiny-idle-use-llama")


class Fixed(RecallPredictor):
    """Predicts what it was given (not registered: no ``name``)."""

    def __init__(self, predictions):
        self.predictions = predictions

    def predict(self, state, expected):
        return list(self.predictions)


def test_predictions_below_the_floor_are_not_prepared_without_a_budget():
    a, b, c = (ChunkRef(key=k, chunk_id=f"c{k}", n_tokens=8) for k in (1, 2, 3))
    likely = Prediction(((a, "end"),), 0.5, 8, 8, "recency")
    unlikely = Prediction(((b, "end"),), MIN_SAVED_PER_FORMED / 2, 8, 8, "group")
    named = Prediction(((c, "end"),), 0.01, 8, 8, "expected")  # what the agent said: always
    plan = plan_recalls(Fixed([likely, unlikely, named]), None, {}, budgeted=False)
    assert plan == [likely, named]
    assert unlikely in plan_recalls(Fixed([likely, unlikely, named]), None, {}, budgeted=True)  # a budget decides there


def test_idle_use_counts_what_anticipation_formed_and_served(backend):
    trace = generate("web", seed=0, steps=12)
    off, on = idle_use_table(backend, [trace], window_options={"beyond_trained": True})
    assert (off.anticipate, on.anticipate) == (False, True)
    assert off.served == 0 and not off.formed and off.hit_rate == 0.0
    assert on.served > 0 and sum(on.formed.values()) > 0 and on.hit_rate > off.hit_rate
    assert on.forwards > off.forwards  # idle work: what a later heal did not need anyway


def test_the_floor_cuts_idle_work_no_step_used(backend, monkeypatch):
    """The web agent's trace healed at every step: without the floor anticipation forms recalls
    the predictor gives ~0 probability; with it, fewer forwards and the same hits and uses."""
    trace = generate("web", seed=0, steps=12)
    options = {"window_options": {"beyond_trained": True}}
    floor = idle_use(backend, trace, **options)
    monkeypatch.setattr(anticipation, "MIN_SAVED_PER_FORMED", 0.0)
    monkeypatch.setattr(anticipate_reorder, "MIN_SAVED_PER_FORMED", 0.0)
    none = idle_use(backend, trace, **options)
    assert floor.forwards < none.forwards and floor.tokens < none.tokens
    assert floor.hit_rate == none.hit_rate and floor.served == none.served
