"""Reorder anticipation (window.anticipate_reorder), the idle healer's anticipation, and patch keys
that name the antecedents' KV states (window.kvstate): what idle time prepares is served exactly
where the KV in front of a chunk is the KV it was formed on, runs no forward on the critical
path and equals the eager policy's window."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import POOL, build_pool_window, micro_llama_backend_fixture, pool_answer_logits

from contextdeque.core.errors import WindowError
from contextdeque.core.metrics import kl_divergence
from contextdeque.patch import form_patch
from contextdeque.window import ContextWindow
from contextdeque.window.anticipate_reorder import (estimated_cost, note_reorder, order_probabilities, patch_needs,
                                                       plan_reorders, prior_orders)

backend = micro_llama_backend_fixture(11, "tiny-reorder-llama")
answer_logits = pool_answer_logits


def build(backend, policy, *, anticipate, budget=22):
    """Five known pages through a budget of four (the first slides out), healed after each."""
    return build_pool_window(backend, policy, anticipate=anticipate, budget=budget)


def served_patches_are_exact(backend, win) -> None:
    """Every patch a slot carries equals the one formed now on the KV in front of it (what a
    state-exact key guarantees for a store hit)."""
    slots = [win.slot(r) for r in win.refs]
    for i, slot in enumerate(slots):
        for cond in slot.stack:
            if cond.formed_on != tuple((s.ref, s.version) for s in slots[:i]):
                continue  # a survivor's kept conditioning (formed on a context that changed): not a hit
            p = cond.patch
            fresh = form_patch(backend, win.chunk(slot.ref), antecedents=[(s.chunk, list(s.patches)) for s in slots[:i]],
                               rank=p.rank_k, rank_v=p.rank_v, kind=p.kind)
            for layer in p.layers:
                for got, want in zip(p.layer_delta(layer), fresh.layer_delta(layer)):
                    assert torch.allclose(got, want, atol=1e-5, rtol=0), f"#{slot.ref.key}: a patch formed on other antecedent states"


def test_an_anticipation_is_not_served_behind_antecedents_in_another_state(backend):
    """A fork anticipated the recall of the page that slid out on its healed pages; a sibling holds
    the same pages (same chunk ids, same order) but one of them in another state (evicted and
    recalled, served blind while unhealed). The recall there must not get the anticipated patch:
    its key names the antecedents' states (keyed by chunk ids it was served, formed on KV the
    sibling does not hold)."""
    win, refs = build(backend, "latency", anticipate=True)
    sibling = win.fork()
    sibling.evict(refs[3])
    sibling.recall(refs[3], at=2)  # same place, but blind until healed
    assert refs[3] in sibling.pending_refs
    r = sibling.recall(refs[0], at="end")
    assert "anticipated" not in {what for _, what in r.served}
    served_patches_are_exact(backend, sibling)
    r = win.recall(refs[0], at="end")  # where the anticipation was formed it is served
    assert r.forwards == 0 and r.served and all(what == "anticipated" for _, what in r.served)
    served_patches_are_exact(backend, win)


ORDERS = {
    "reverse": lambda refs: list(reversed(refs)),
    "swap-front": lambda refs: [refs[1], refs[0], *refs[2:]],
    "to-end": lambda refs: [*refs[1:], refs[0]],
    "middle-swap": lambda refs: [refs[0], refs[2], refs[1], refs[3]],
}


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_an_expected_reorder_runs_no_forward_and_equals_eager(backend, name):
    eager, _ = build(backend, "eager", anticipate=False)
    fast, _ = build(backend, "latency", anticipate=True)
    fast.expect_order(ORDERS[name](list(fast.refs)))
    fast.heal()
    r_eager = eager.reorder(ORDERS[name](list(eager.refs)))
    r_fast = fast.fork().reorder(ORDERS[name](list(fast.refs)))  # (a fork: the store is shared)
    assert r_eager.forwards > 0
    assert r_fast.forwards == 0 and not r_fast.deferred
    assert r_fast.served and all(what == "anticipated" for _, what in r_fast.served)


def test_reorder_anticipation_heals_to_the_eager_window(backend):
    """The reorder the prior ranks first (the reverse) is prepared with no hint; served from the
    store, the window equals the eager policy's (KL <= 1e-6)."""
    eager, _ = build(backend, "eager", anticipate=False)
    fast, _ = build(backend, "latency", anticipate=True)
    r_eager = eager.reorder(list(reversed(eager.refs)))
    r_fast = fast.reorder(list(reversed(fast.refs)))
    assert r_eager.forwards > 0 and r_fast.forwards == 0 and not r_fast.deferred
    assert kl_divergence(answer_logits(backend, eager), answer_logits(backend, fast)) <= 1e-6
    assert fast.heal().forwards == 0 or kl_divergence(answer_logits(backend, eager), answer_logits(backend, fast)) <= 1e-6


def test_without_anticipation_a_reorder_is_served_as_before(backend):
    win, _ = build(backend, "latency", anticipate=False)
    r = win.reorder(list(reversed(win.refs)))
    assert r.forwards == 0 and r.deferred and "anticipated" not in {what for _, what in r.served}


def test_probabilities_learn_from_the_family_and_hints_come_first(backend):
    win, _ = build(backend, "latency", anticipate=False)
    refs = list(win.refs)
    swap_middle = (0, 2, 1, 3)
    before = order_probabilities(win._ctx.reorders_seen, 4)[swap_middle]
    assert set(prior_orders(4)) >= {(3, 2, 1, 0), (1, 0, 2, 3), (1, 2, 3, 0)} and (0, 1, 2, 3) not in prior_orders(4)
    assert abs(sum(prior_orders(4).values()) - 1.0) < 1e-9
    child = win.fork()
    child.reorder([refs[0], refs[2], refs[1], refs[3]])  # the family reorders so once
    after = order_probabilities(win._ctx.reorders_seen, 4)[swap_middle]
    assert after > before and after == max(order_probabilities(win._ctx.reorders_seen, 4).values())
    with pytest.raises(WindowError):
        win.expect_order(refs[:3])


def test_cost_estimate_counts_the_eager_policys_forwards(backend):
    for name, make in ORDERS.items():
        eager, _ = build(backend, "eager", anticipate=False)  # (a store of its own: the estimate looks nothing up)
        slots = [eager.slot(r) for r in make(list(eager.refs))]
        forwards, formed, fixed = estimated_cost(slots, eager._ctx.policy)
        r = eager.fork().reorder(make(list(eager.refs)))
        assert forwards == r.forwards, name
        assert fixed <= formed


def test_the_idle_healer_anticipates(backend):
    """Nothing queued: the healer runs the anticipation pass heal() would, in the background; the
    recall of the page that left then runs no forward and is served what anticipation stored."""
    win = ContextWindow(backend, budget_tokens=22, rank=2, patch_policy="latency", anticipate=True)
    refs = [win.append(chunk=backend.encode(token_ids=p)) for p in POOL[:5]]
    with win.start_healing(idle_ms=0) as healer:
        assert healer.wait_idle(timeout=120)
    assert healer.anticipations >= 1 and not healer.errors and not win.anticipation_due
    r = win.recall(refs[0], at="end")
    assert r.forwards == 0 and not r.deferred and all(what == "anticipated" for _, what in r.served)


def test_a_foreground_step_interrupts_the_healers_anticipation_cleanly(backend):
    """Foreground steps arrive while the healer anticipates: each runs on a whole window (the
    healer's step in flight is abandoned, never half-installed) and the window ends equal to the
    eager one's after heal."""
    eager, e_refs = build(backend, "eager", anticipate=False)
    win = ContextWindow(backend, budget_tokens=22, rank=2, patch_policy="latency", anticipate=True)
    refs = [win.append(chunk=backend.encode(token_ids=p)) for p in POOL[:5]]
    with win.start_healing(idle_ms=0) as healer:
        for i in range(6):
            time.sleep(0.01 * i)
            win.materialize()
        win.reorder(list(reversed(win.refs)))
        eager.reorder(list(reversed(eager.refs)))
        assert healer.wait_idle(timeout=120)
    assert not healer.errors
    win.heal()
    eager.heal()
    assert kl_divergence(answer_logits(backend, eager), answer_logits(backend, win)) <= 1e-6
    served_patches_are_exact(backend, win)


EQUAL_PAGES = [[10 + 7 * i + j for j in range(6)] for i in range(5)]


def build_equal(backend, policy, *, anticipate):
    """Five equal pages through a budget of four (the window-bench's shape: the first slides out)."""
    win = ContextWindow(backend, budget_tokens=24, rank=2, patch_policy=policy, anticipate=anticipate)
    for p in EQUAL_PAGES:
        win.append(chunk=backend.encode(token_ids=p))
        win.heal(anticipate=False)
    return win


def test_a_forks_front_swap_is_prepared_without_a_hint(backend):
    """window-bench's fork+reorder: a fork of a fork swaps the first two pages, with no hint. Its
    orbit patches (the pages behind the swap keep their antecedent set) serve other orders too,
    so priced per patch the swap is prepared in idle time: 0 forwards, every chunk anticipated,
    and the window equals the eager policy's. (Priced per order, it ranked below four others and
    was served blind.)"""
    eager = build_equal(backend, "eager", anticipate=False)
    fast = build_equal(backend, "latency", anticipate=True)
    fast.heal()
    swap = lambda refs: [refs[1], refs[0], *refs[2:]]  # noqa: E731
    r_eager = eager.reorder(swap(list(eager.refs)))
    child = fast.fork().fork()
    r_fast = child.reorder(swap(list(child.refs)))
    assert r_eager.forwards > 0
    assert r_fast.forwards == 0 and not r_fast.deferred
    assert r_fast.served and all(what == "anticipated" for _, what in r_fast.served)
    assert kl_divergence(answer_logits(backend, eager), answer_logits(backend, child)) <= 1e-6


def test_orders_the_family_never_takes_are_not_prepared(backend):
    """A family that always reverses: the prior's other shapes keep ~0 probability, and their
    patches are not formed (idle work no step would use); the reverse is."""
    win = build_equal(backend, "latency", anticipate=False)
    refs = list(win.refs)
    for _ in range(60):
        note_reorder(win._ctx.reorders_seen, refs, list(reversed(refs)))
    planned = plan_reorders(win._ctx.policy.eager, win._ctx.reorders_seen, [], [win.slot(r) for r in refs])
    assert planned == [list(reversed(refs))]
    assert len(plan_reorders(win._ctx.policy.eager, type(win._ctx.reorders_seen)(), [], [win.slot(r) for r in refs])) > 1


def test_an_orbit_patch_is_priced_by_every_order_it_serves(backend):
    """The orbit patch of the last page over the first three serves every order that permutes
    them: once one such order is prepared, another needs only its own exact patches."""
    win = build_equal(backend, "eager", anticipate=False)
    slots = [win.slot(r) for r in win.refs]
    eager = win._ctx.policy
    swap_front = patch_needs([slots[1], slots[0], slots[2], slots[3]], eager)
    swap_middle = patch_needs([slots[0], slots[2], slots[1], slots[3]], eager)
    orbit = [n for n, _, _ in swap_front if n[0] == "orbit" and n[1] == slots[3].ref.chunk_id]
    assert orbit and orbit[0] in {n for n, _, _ in swap_middle}
    assert [f for n, f, _ in swap_front if n in orbit] == [6]  # one forward per ordering of its three antecedents
    assert estimated_cost([slots[1], slots[0], slots[2], slots[3]], eager)[0] == sum(f for _, f, _ in swap_front)


@pytest.mark.parametrize(("order", "need"), [((0, 2, 1, 3), "reforward"), ((2, 0, 1, 3), "canonical")],
                         ids=["behind-the-front", "to-the-front"])
def test_a_reorder_that_moves_new_content_is_prepared(backend, order, need):
    """Latency-first new content has no canonical: a reorder that moves it defers its conditioned
    re-forward to ``heal`` (behind the front), or its canonical (brought to the front: served there
    as its own forward on what used to be in front of it). The order the agent named is prepared
    anyway (the re-forward run in idle time and kept, ``window.prepared``; the canonical made where
    the chunk stands, ``anticipation.anticipate_canonical``, before the order's patches): the reorder
    runs no forward, serves nothing stale or blind, and holds what the reorder plus heal hold
    without anticipation (KL <= 1e-6). (Before: ``patch_needs`` was None for either; then the
    front's canonical stayed None: never prepared.)"""
    from contextdeque.core.metrics import kl_divergence
    from contextdeque.window import ContextWindow
    from contextdeque.window.anticipate_reorder import patch_needs
    from helpers import POOL, pool_answer_logits

    def run(anticipate):
        win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=anticipate)
        # new content (provisional, no canonical) but the second page, known (its canonical
        # stored: no slide to prepare, whose canonical the window without anticipation lacks)
        refs = [win.append(chunk=backend.encode(token_ids=p)) if i == 1 else win.append(token_ids=p)
                for i, p in enumerate(POOL[:4])]
        win.heal(anticipate=False)
        new_order = [refs[i] for i in order]
        assert win.slot(refs[2]).provisional
        if anticipate:
            needs = patch_needs([win.slot(r) for r in new_order], win._ctx.policy.eager)
            assert need in {n[0][0] for n in needs}
            win.expect_order(new_order)
            win.heal()
            assert not win.slot(refs[2]).provisional or need == "reforward"  # (the canonical, where it stood)
        return win, win.reorder(new_order)

    fast, r = run(True)
    assert r.forwards == 0 and r.answered_fresh and not r.deferred and not fast.pending_refs
    assert any(what == "anticipated" for _, what in r.served)
    slow, r_slow = run(False)
    assert r_slow.deferred and slow.pending_refs
    slow.heal()
    assert kl_divergence(pool_answer_logits(backend, slow), pool_answer_logits(backend, fast)) <= 1e-6


def test_a_hinted_reorder_s_estimate_charges_forwards_and_patches():
    """A recall chain with the reorder the agent named after it (``recall_cost``) and a reorder
    alone (``reorder_cost``) are priced as the budget spends them (``healing.IdlePrices``): per
    chunk re-conditioned its tokens, a forward's fixed part and, but for a provisional chunk, its
    patch's factorization per token and per patch; a chunk brought to the front costs nothing (its
    canonical is exact there). (Before: the hinted reorder's tokens x (1 + per-token charge) only.)"""
    from types import SimpleNamespace

    from contextdeque.window.anticipation import recall_cost, reorder_after, reorder_cost
    from contextdeque.window.healing import IdlePrices
    from contextdeque.window.predictor import Prediction
    from contextdeque.window.ref import ChunkRef

    a, b, c, d = (ChunkRef(i, f"c{i}", 10) for i in range(4))
    slot = lambda ref, n, provisional=False: SimpleNamespace(ref=ref, n_tokens=n, provisional=provisional)  # noqa: E731

    class Graph:
        @staticmethod
        def preview_cascade(ref, order):
            return ()

    state = SimpleNamespace(slots=[slot(a, 10), slot(b, 20, True), slot(c, 30)], refs=[a, b, c],
                            evicted={d: SimpleNamespace(n_tokens=40, owes_encode=False)}, graph=Graph())
    prices = IdlePrices(factorization_cost=0.5, factorization_fixed=3.0, forward_fixed=7.0)
    recalls = ((d, 3),)
    then = reorder_after(state, recalls, [(a, c, b, d)])
    assert then == [c, b, d]
    chain = 40 + 7.0 + 0.5 * 40 + 3.0  # the recalled chunk: its forward and its patch
    reorder = (30 + 20 + 40) + 3 * 7.0 + 0.5 * (30 + 40) + 2 * 3.0  # b is provisional: re-forwarded, not factorized
    prediction = Prediction(recalls, 1.0, 40, 40, "test")
    assert recall_cost(state, prediction, then, prices) == pytest.approx(chain + reorder)
    assert recall_cost(state, prediction, (), prices) == pytest.approx(chain)
    assert reorder_cost(state, [a, c, b], prices) == pytest.approx(30 + 20 + 2 * 7.0 + 0.5 * 30 + 3.0)
    assert reorder_cost(state, [c, a, b], prices) == pytest.approx(10 + 20 + 2 * 7.0 + 0.5 * 10 + 3.0)  # c: front, free
