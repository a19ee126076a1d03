"""Resumable forming across idle gaps (window.anticipation.ResumableForming): a preparation too
dear for one gap is started with the gap's rest and finished in a later gap; no gap is charged
more than its budget; the patch formed in pieces equals the one formed at once; progress the
window moved past is dropped and counted; and a forward split by layer ranges (the hidden state
and the partial KV kept between the pieces, ``model.forward.run_layers``) gives the whole
forward's KV."""

from __future__ import annotations

import pytest
import torch
from helpers import POOL, micro_llama_backend_fixture, pool_answer_logits

from contextdeque.core.errors import UnsupportedLayoutError
from contextdeque.model.forward import run_deep_forward, run_forward, run_hidden_at, run_layers
from contextdeque.window import ContextWindow
from contextdeque.window.anticipation import FormingTask, Preparation, ResumableForming, forming_task
from contextdeque.window.healing import HealBudget, IdlePrices, idle_spent

backend = micro_llama_backend_fixture(7, "tiny-resumable-llama")


# ---------------------------------------------------------------------- the forward in pieces
@pytest.mark.parametrize("cuts", [(1,), (1, 2), (2,)], ids=lambda c: "cut-" + "-".join(map(str, c)))
def test_a_forward_run_layer_range_by_range_equals_the_whole(tiny_backend_factory, cuts):
    """The oracle of a forming forward split across gaps: run the layers range by range, each
    range from the hidden state the one before left, after the same past: every layer's KV equals
    transformers' own forward of the chunk at once (within 1e-6)."""
    be = tiny_backend_factory("llama", num_hidden_layers=3)
    L = be.model.config.num_hidden_layers
    assert L == 3
    past = be.root_kv()
    ids = torch.tensor([7, 8, 9, 10, 11, 12])
    pos = be.text_positions(past[0][0].shape[-2], len(ids))
    whole, _ = run_forward(be.model, be.n_pos_axes, input_ids=ids, positions=pos, past=past, logits="none")
    hidden = run_hidden_at(be.model, be.n_pos_axes, input_ids=ids, positions=pos, past=past, layer=0)
    pieces = []
    for first, last in zip((0, *cuts), (*cuts, L)):
        hidden, kv = run_layers(be.model, be.n_pos_axes, hidden=hidden, first_layer=first, last_layer=last,
                                positions=pos, past=past)
        pieces.extend(kv)
    assert len(pieces) == L
    for (k, v), (wk, wv) in zip(pieces, whole):
        assert torch.allclose(k, wk, atol=1e-6, rtol=0) and torch.allclose(v, wv, atol=1e-6, rtol=0)
    # the hidden state between ranges is the one transformers' forward has there
    mid = run_hidden_at(be.model, be.n_pos_axes, input_ids=ids, positions=pos, past=past, layer=cuts[0])
    first_piece, _ = run_layers(be.model, be.n_pos_axes, hidden=run_hidden_at(
        be.model, be.n_pos_axes, input_ids=ids, positions=pos, past=past, layer=0), first_layer=0,
        last_layer=cuts[0], positions=pos, past=past)
    assert torch.allclose(first_piece, mid, atol=1e-6, rtol=0)
    # the shallow-recompute miss path's deep-only forward is the last range
    deep = run_deep_forward(be.model, be.n_pos_axes, hidden=mid, first_layer=cuts[0], positions=pos, past=past)
    for (k, v), (wk, wv) in zip(deep, whole[cuts[0]:]):
        assert torch.allclose(k, wk, atol=1e-6, rtol=0) and torch.allclose(v, wv, atol=1e-6, rtol=0)


def test_a_layer_range_outside_the_model_is_refused(tiny_backend_factory):
    be = tiny_backend_factory("llama")
    L = be.model.config.num_hidden_layers
    with pytest.raises(UnsupportedLayoutError):
        run_layers(be.model, be.n_pos_axes, hidden=torch.zeros(2, be.model.config.hidden_size), first_layer=1,
                   last_layer=L + 1, positions=be.text_positions(0, 2), past=[])


# ---------------------------------------------------------------------- the rule
def _task(recalls, arrangement, head_cost=10.0, head_len=None) -> FormingTask:
    return FormingTask(("recalls", tuple(recalls), (), ()), tuple(arrangement),
                       len(arrangement) if head_len is None else head_len, head_cost)


def test_the_gap_s_rest_goes_to_the_best_task_that_did_not_fit_and_is_credited_later():
    forming = ResumableForming()
    task = _task([("a", 1)], ("s0", "s1"), head_cost=10.0, head_len=1)
    gap = HealBudget(max_tokens=4)
    forming.begin_pass()
    assert not gap.fits(forming.cost(task, 10.0))
    forming.missed(task)
    forming.missed(_task([("b", 1)], ("s0", "s1")))  # a worse one: not the one started
    forming.end_pass(gap)
    assert forming.progress == 4 and forming.task is task and gap.tokens == gap.max_tokens  # the whole gap used
    gap = HealBudget(max_tokens=4)
    forming.begin_pass()
    assert forming.cost(task, 10.0) == 6 and not gap.fits(6)
    forming.missed(task)
    forming.end_pass(gap)
    assert forming.progress == 8
    gap = HealBudget(max_tokens=4)
    forming.begin_pass()
    assert gap.fits(forming.cost(task, 10.0))  # 2 left to do
    before = gap.tokens
    gap.tokens += 10.0  # what the preparation's receipt costs as it ran, whole
    forming.ran(task, gap, before)
    assert gap.tokens == 2.0 <= gap.max_tokens  # the gap is charged the rest only
    assert (forming.banked, forming.used, forming.lost, forming.task) == (8.0, 8.0, 0.0, None)


def test_progress_the_window_moved_past_is_dropped_and_counted():
    forming = ResumableForming()
    task = _task([("a", 1)], ("s0", "s1"), head_cost=3.0, head_len=1)
    forming.begin_pass()
    forming.missed(task)
    forming.end_pass(HealBudget(max_tokens=5))
    # a page appended behind where the recall goes: its own forward (3) still holds, the rest not
    grown = _task([("a", 1)], ("s0", "s1", "s2"), head_cost=3.0, head_len=1)
    assert forming.credit(grown) == 3.0 and forming.lost == 2.0
    # the slot in front of it changed: nothing holds
    moved = _task([("a", 1)], ("x0", "s1", "s2"), head_cost=3.0, head_len=1)
    assert forming.credit(moved) == 0.0 and forming.lost == 5.0 and forming.task is None
    # the prediction changed: the one in progress is dropped when another is started
    forming.begin_pass()
    forming.missed(task)
    forming.end_pass(HealBudget(max_tokens=2))
    other = _task([("b", None)], ("s0", "s1"))
    forming.begin_pass()
    forming.missed(other)
    forming.end_pass(HealBudget(max_tokens=2))
    assert forming.task is other and forming.progress == 2 and forming.lost == 7.0


def test_a_recall_chain_s_head_is_its_own_chunks_in_front_of_where_they_go(backend):
    win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=True)
    refs = [win.append(chunk=backend.encode(token_ids=p)) for p in POOL[:4]]
    win.evict(refs[1])
    state = win._state
    per_token = IdlePrices(factorization_cost=0.5)
    pinned = forming_task(Preparation("recalls", 1.0, recalls=((refs[1], 1),)), ("a", "b", "c"), state, per_token)
    assert pinned.head_len == 1 and pinned.head_cost == len(POOL[1]) * 1.5
    # the per-patch and per-forward charges too (healing.IdlePrices), as the budget spends them
    fixed = forming_task(Preparation("recalls", 1.0, recalls=((refs[1], 1),)), ("a", "b", "c"), state,
                         IdlePrices(factorization_cost=0.5, factorization_fixed=3.0, forward_fixed=7.0))
    assert fixed.head_cost == len(POOL[1]) * 1.5 + 3.0 + 7.0
    at_end = forming_task(Preparation("recalls", 1.0, recalls=((refs[1], "end"),)), ("a", "b", "c"), state, per_token)
    assert at_end.head_len == 3
    whole = forming_task(Preparation("recalls", 1.0, recalls=((refs[1], 1),)), ("a", "b", "c"), state, per_token, whole=True)
    assert whole.head_len == 3
    win.close()


# ---------------------------------------------------------------------- the window executes it
def _look_back_window(backend):
    """Four known pages, the second evicted and named as the next re-read (back at index 2),
    the queued work healed: what is left for idle time is that recall's preparation."""
    win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=True)
    refs = [win.append(chunk=backend.encode(token_ids=p)) for p in POOL[:4]]
    win.heal(anticipate=False)
    win.evict(refs[1])
    win.heal(anticipate=False)
    win.expect(refs[1], at=2)  # (behind the third page: a new arrangement, nothing stored for it)
    return win, refs


def test_a_preparation_formed_over_several_gaps_equals_the_one_formed_at_once(backend):
    """Gaps of 3 tokens, each too short for the look-back's forming (its forward and its
    dependents'): the first gaps form nothing and charge nothing beyond their budget, the
    preparation runs in the gap where the rest fits, and the look-back then runs 0 forwards,
    served what anticipation formed, with the same answer logits (bit-equal) as a window that
    formed it in one long gap."""
    at_once, refs_a = _look_back_window(backend)
    at_once.heal()
    r_once = at_once.recall(refs_a[1], at=2)
    pieces, refs_p = _look_back_window(backend)
    gaps = 0
    while not pieces.forming.used:
        receipt = pieces.heal(max_tokens=3)
        gaps += 1
        spent = idle_spent((receipt,), pieces._ctx.config.factorization_cost)
        if pieces.forming.used:
            assert receipt.forwards > 0 and spent - pieces.forming.used <= 3  # the last gap: the rest only
        else:
            assert receipt.forwards == 0 and pieces.forming.progress == 3 * gaps
        assert gaps < 50
    forming = pieces.forming
    assert gaps > 1 and forming.banked == forming.used + forming.lost + forming.progress
    r_pieces = pieces.recall(refs_p[1], at=2)
    assert r_pieces.forwards == r_once.forwards == 0
    assert r_pieces.served and all(what == "anticipated" for _, what in r_pieces.served)
    assert [what for _, what in r_pieces.served] == [what for _, what in r_once.served]
    assert torch.equal(pool_answer_logits(backend, pieces), pool_answer_logits(backend, at_once))


def test_without_carrying_over_the_short_gaps_form_nothing(backend):
    """The same gaps with the carry-over dropped after each (what a single-gap budget did): the
    look-back is never prepared (its forwards run on the critical path or are deferred)."""
    win, refs = _look_back_window(backend)
    for _ in range(20):
        win.heal(max_tokens=3)
        win.forming.task, win.forming.progress = None, 0.0
    assert not win._ctx.anticipated_keys
    r = win.recall(refs[1], at=2)
    assert not (r.served and all(what == "anticipated" for _, what in r.served))
