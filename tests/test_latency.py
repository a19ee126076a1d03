"""Latency-first reuse: re-read operations run no forward on the critical path, deferred
conditioning is queued, and heal() (or the idle healer) brings the window to what the eager
policy builds, transactionally."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import micro_llama

from contextdeque.core import compat
from contextdeque.model.hf import HFBackend
from contextdeque.core.cooperative import Interrupted, background, install_layer_checkpoints
from contextdeque.window import ContextWindow, LatencyPolicy
from contextdeque.core.metrics import kl_divergence

POOL = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15], [20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36], [40, 41, 42]]
QUERY = [50, 51, 52]


@pytest.fixture(scope="module")
def backend(one_thread):
    return HFBackend(micro_llama(7), None, root_ids=[1, 3], name="tiny-latency-llama")


def kv_of(win: ContextWindow) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = win.materialize()
    return [tuple(t[0].clone() for t in compat.cache_layer(cache, l)) for l in range(compat.cache_num_layers(cache))]


def next_token_logits(backend: HFBackend, win: ContextWindow) -> torch.Tensor:
    past = kv_of(win)
    start = win.next_position()
    return backend.forward(input_ids=QUERY, positions=backend.text_positions(start, len(QUERY)), past=past).logits[-1]


def window_ids(win: ContextWindow) -> list[int]:
    ids = list(win.root_ids)
    for r in win.refs:
        ids += win.chunk(r).token_ids.tolist()
    return ids


def reprefill_logits(backend: HFBackend, win: ContextWindow) -> torch.Tensor:
    ids = window_ids(win) + QUERY
    return backend.forward(input_ids=ids, positions=backend.text_positions(0, len(ids))).logits[-1]


def build(backend, policy, rank=2, budget=17, anticipate=False):
    """A window over content whose canonicals exist (appended as chunks): the latency-first
    policy then heals to exactly what the eager policy builds. (New content with no canonical
    stays provisional: see the tests further down.) ``anticipate=False``: the latency-first
    policy as it is without anticipation (what these tests pin down; with it, see
    test_anticipation*.py and ``test_reread_with_anticipation_heals_to_eager``)."""
    win = ContextWindow(backend, budget_tokens=budget, rank=rank, patch_policy=policy, anticipate=anticipate)
    refs = []
    for p in POOL[:4]:  # the budget slides the first one out
        refs.append(win.append(chunk=backend.encode(token_ids=p)))
        win.heal()  # healed before the next operation: the eager policy's window, step by step
    return win, refs


def provisional_window(backend, n=4, rank=2):
    win = ContextWindow(backend, rank=rank, patch_policy="latency", anticipate=False)
    refs = [win.append(token_ids=p) for p in POOL[:n]]
    win.heal()
    return win, refs


def test_content_read_where_it_was_forwarded_never_needs_a_canonical(backend):
    """Appended content keeps the KV of its one conditioned forward: heal computes no canonical
    for it (only the front's, which is exact there), and the window equals a re-prefill."""
    win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=False)
    refs = [win.append(token_ids=p) for p in POOL[:4]]
    assert refs[0].receipt.encodes == 1  # nothing in front: its canonical
    assert all(r.receipt.forwards == 1 and r.receipt.encodes == 0 for r in refs[1:])  # a prefix cache's append
    healed = win.heal()
    assert healed.forwards == 0 and healed.encodes == 0 and not win.pending_refs
    assert [win.slot(r).provisional for r in win.refs] == [False, True, True, True]
    assert kl_divergence(reprefill_logits(backend, win), next_token_logits(backend, win)) <= 1e-6
    win.slide(1)  # the next one reaches the front: its canonical (exact there) at the heal
    healed = win.heal()
    assert healed.encodes == 1 and healed.forwards == 1
    assert [win.slot(r).provisional for r in win.refs] == [False, True, True]


def test_content_moved_is_reforwarded_not_canonicalized(backend):
    """Where the eager policy would form a patch (a reorder), heal runs one conditioned forward
    behind the new prefix instead: no canonical, and the healed window is exact."""
    win, refs = provisional_window(backend)
    rc = win.reorder([refs[0], refs[3], refs[1], refs[2]])
    assert rc.forwards == 0 and set(win.pending_refs) == {refs[1], refs[2], refs[3]}
    healed = win.heal()
    assert healed.encodes == 0 and healed.forwards == 3 and not win.pending_refs
    assert all(win.slot(r).provisional for r in win.refs[1:])
    assert kl_divergence(reprefill_logits(backend, win), next_token_logits(backend, win)) <= 1e-6
    stored = set(win.store.store.keys())
    assert not any(win.store.chunk_key(win.chunk(r)) in stored for r in refs[1:])  # never encoded alone


def test_content_that_left_before_its_canonical_is_forwarded_where_it_returns(backend):
    """A provisional chunk evicted keeps only its source: nothing encodes it at the heal, and a
    recall runs one conditioned forward where it re-enters (what a prefix cache re-reading it
    runs), still with no canonical; at the front, its canonical."""
    win, refs = provisional_window(backend)
    win.evict(refs[2])
    assert win.heal().forwards == 0
    rc = win.recall(refs[2], at=1)
    assert rc.forwards == 1 and rc.encodes == 0 and win.slot(refs[2]).provisional
    # behind it: refs[1] keeps its KV (an insertion, as under the eager policy), refs[3] was
    # formed on refs[2]'s old KV: the recall cascade re-forwards it
    healed = win.heal()
    assert healed.forwards == 1 and healed.encodes == 0 and refs[3] in healed.refs
    assert dict(win.slot(refs[3]).inline_on)[refs[2]] == win.slot(refs[2]).version  # on the recalled KV
    win.evict(refs[3])
    rc = win.recall(refs[3], at=0)
    assert rc.encodes == 1 and not win.slot(refs[3]).provisional


# each op: (name, function(window, refs) -> Receipt-or-window)
def op_slide(w, refs):
    return w, w.slide(1)


def op_evict(w, refs):
    return w, w.evict(w.refs[1])


def op_recall(w, refs):
    ref = w.refs[0]
    w.evict(ref)
    return w, w.recall(ref)


def op_lookback(w, refs):
    return w, w.recall(refs[0], at=0)


def op_lookback_middle(w, refs):
    return w, w.recall(refs[0], at=1)


def op_reorder(w, refs):
    return w, w.reorder(list(reversed(w.refs)))


def op_fork_reorder(w, refs):
    child = w.fork()
    return child, child.reorder(list(reversed(child.refs)))


def op_swap_front(w, refs):
    """A pure permutation of each later slot's antecedents: the eager policy forms orbit patches;
    the latency stand-ins are blind (their stale patch dropped), and heal must still decide on
    what they carried before (found by window-bench's fork+reorder row)."""
    child = w.fork()
    r = list(child.refs)
    return child, child.reorder([r[1], r[0], *r[2:]])


REREADS = [op_slide, op_evict, op_recall, op_lookback, op_lookback_middle, op_reorder, op_fork_reorder, op_swap_front]


@pytest.mark.parametrize("op", REREADS, ids=lambda f: f.__name__[3:])
def test_reread_runs_no_forward_and_heals_to_eager(backend, op):
    eager, e_refs = build(backend, "eager")
    lat, l_refs = build(backend, "latency")
    assert all(torch.equal(a, b) for x, y in zip(kv_of(eager), kv_of(lat)) for a, b in zip(x, y))
    e_win, e_rc = op(eager, e_refs)
    l_win, l_rc = op(lat, l_refs)
    assert l_rc.forwards == 0 and l_rc.encodes == 0
    assert {r for r, _, _ in l_rc.deferred} == set(l_win.pending_refs)
    for _, served, score in l_rc.deferred:
        assert served in ("stale", "blind") and 0.0 <= score <= 1.0
    kl_answer = kl_divergence(next_token_logits(backend, e_win), next_token_logits(backend, l_win))
    assert kl_answer >= 0.0
    healed = l_win.heal()
    assert not l_win.pending_refs
    assert healed.forwards == e_rc.forwards  # the same forming work, moved off the critical path
    for (k1, v1), (k2, v2) in zip(kv_of(e_win), kv_of(l_win)):
        assert torch.allclose(k1, k2, atol=1e-6, rtol=0) and torch.allclose(v1, v2, atol=1e-6, rtol=0)
    assert kl_divergence(next_token_logits(backend, e_win), next_token_logits(backend, l_win)) <= 1e-6


@pytest.mark.parametrize("op", REREADS, ids=lambda f: f.__name__[3:])
def test_reread_with_anticipation_heals_to_eager(backend, op):
    """Anticipation on (the default): the re-read still runs no forward on the critical path
    (served what idle time prepared, else stale / blind and queued), and after heal the window
    equals the eager policy's."""
    eager, e_refs = build(backend, "eager", anticipate=True)  # the same settings, the eager policy
    lat, l_refs = build(backend, "latency", anticipate=True)
    e_win, _ = op(eager, e_refs)
    l_win, l_rc = op(lat, l_refs)
    assert l_rc.forwards == 0 and l_rc.encodes == 0
    assert {r for r, _, _ in l_rc.deferred} == set(l_win.pending_refs)
    l_win.heal()
    assert not l_win.pending_refs
    for (k1, v1), (k2, v2) in zip(kv_of(e_win), kv_of(l_win)):
        assert torch.allclose(k1, k2, atol=1e-6, rtol=0) and torch.allclose(v1, v2, atol=1e-6, rtol=0)
    assert kl_divergence(next_token_logits(backend, e_win), next_token_logits(backend, l_win)) <= 1e-6


def test_append_costs_one_forward_like_a_prefix_cache(backend):
    """New content: one conditioned forward (the window then equals a re-prefill), and healing
    leaves it so: no canonical, no patch, nothing to do."""
    win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=False)
    first = win.append(token_ids=POOL[0])
    assert first.receipt.encodes == 1  # nothing in front: the canonical (+ the root's forward, if first)
    ref = win.append(token_ids=POOL[1])
    rc = ref.receipt
    assert rc.forwards == 1 and rc.encodes == 0 and rc.tokens_prefilled == len(POOL[1])
    assert win.pending_refs == (ref,) and rc.deferred == ((ref, "conditioned", 0.0),)
    assert kl_divergence(reprefill_logits(backend, win), next_token_logits(backend, win)) <= 1e-6
    healed = win.heal()
    assert healed.forwards == 0 and healed.encodes == 0 and not win.pending_refs
    assert kl_divergence(reprefill_logits(backend, win), next_token_logits(backend, win)) <= 1e-6


@pytest.mark.parametrize("anticipate", [True, False], ids=["anticipation", "no-anticipation"])
def test_full_rank_latency_heals_to_reprefill(backend, anticipate):
    win = ContextWindow(backend, budget_tokens=22, rank=64, patch_policy="latency:exact", anticipate=anticipate)
    refs = [win.append(token_ids=p) for p in POOL]
    win.reorder(list(reversed(win.refs)))
    win.recall(refs[0], at=1)
    win.slide(1)
    assert win.pending_refs
    win.heal()
    assert not win.pending_refs
    kl = kl_divergence(reprefill_logits(backend, win), next_token_logits(backend, win))
    assert kl <= 1e-4


def test_heal_budget_in_steps(backend):
    win, refs = build(backend, "latency")
    win.reorder(list(reversed(win.refs)))
    n = len(win.pending_refs)
    assert n >= 2
    rc = win.heal(max_steps=1)
    assert 0 < len(rc.refs) and len(win.pending_refs) == n - len(rc.refs)
    assert win.heal(max_ms=0).refs == ()  # no time: nothing done
    win.heal()
    assert not win.pending_refs


def test_interrupted_heal_leaves_window_as_it_was(backend):
    win, refs = build(backend, "latency")
    win.reorder(list(reversed(win.refs)))
    before_kv, before_pending, gen = kv_of(win), win.pending_refs, win.generation
    calls = {"n": 0}

    def stop_after_two() -> bool:
        calls["n"] += 1
        return calls["n"] > 2

    remove = install_layer_checkpoints(backend.model)
    try:
        with background(stop_after_two):
            with pytest.raises(Interrupted):
                win._heal_step()
    finally:
        remove()
    assert calls["n"] > 2
    assert win.pending_refs == before_pending and win.generation == gen
    assert all(torch.equal(a, b) for x, y in zip(before_kv, kv_of(win)) for a, b in zip(x, y))
    win.heal()  # and it can still be healed afterwards
    assert not win.pending_refs


def test_idle_healer_heals_and_yields_to_foreground(backend):
    eager, e_refs = build(backend, "eager")
    lat, l_refs = build(backend, "latency")
    with lat.start_healing(idle_ms=0) as healer:
        for w in (eager, lat):
            w.reorder(list(reversed(w.refs)))
            assert healer.wait_idle(timeout=120)  # the agent "waits on a page": the healer works
            w.recall(w.evicted_refs[0], at=1)
            assert healer.wait_idle(timeout=120)
        assert not healer.errors and healer.steps > 0
    assert not healer.running
    for (k1, v1), (k2, v2) in zip(kv_of(eager), kv_of(lat)):
        assert torch.allclose(k1, k2, atol=1e-6, rtol=0) and torch.allclose(v1, v2, atol=1e-6, rtol=0)


def test_foreground_interrupts_a_background_step(backend):
    """A foreground operation arriving while a heal step runs makes the step give way (it is
    abandoned whole) and runs; the window stays consistent and heals afterwards."""
    lat, _ = build(backend, "latency")
    lat.reorder(list(reversed(lat.refs)))
    entered, release = threading.Event(), threading.Event()

    def stop_when_foreground() -> bool:
        entered.set()
        release.wait(5)
        return lat.context.foreground_waiting()

    errors: list[BaseException] = []

    def worker():
        try:
            with background(stop_when_foreground):
                lat._heal_step()
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion below
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    assert entered.wait(10)
    fg = threading.Thread(target=lambda: lat.materialize())
    fg.start()
    while not lat.context.foreground_waiting():
        pass
    release.set()
    t.join(10)
    fg.join(10)
    assert len(errors) == 1 and isinstance(errors[0], Interrupted)
    assert lat.pending_refs  # the abandoned step changed nothing
    lat.heal()
    assert not lat.pending_refs


def test_policy_spec_and_errors(backend):
    pol = ContextWindow(backend, patch_policy="latency:exact").policy
    assert isinstance(pol, LatencyPolicy) and pol.eager.name == "exact" and pol.regime == "exact"
    with pytest.raises(Exception):
        LatencyPolicy(staleness_budget=2.0)
    with pytest.raises(Exception):
        LatencyPolicy(inner=LatencyPolicy())
    eager = ContextWindow(backend, patch_policy="eager")
    eager.append(token_ids=POOL[0])
    assert eager.heal().forwards == 0 and not eager.pending_refs


@pytest.mark.parametrize("op", [op_slide, op_recall, op_reorder, op_swap_front], ids=lambda f: f.__name__[3:])
def test_latency_shared_heals_new_content_to_eager(backend, op):
    """``latency-shared`` computes every canonical while healing (the patch from the difference,
    no second forward): healed, a window of new content is the eager policy's, bit for bit."""
    def fresh(policy):
        win = ContextWindow(backend, budget_tokens=17, rank=2, patch_policy=policy, anticipate=False)
        refs = []
        for p in POOL[:4]:
            refs.append(win.append(token_ids=p))
            win.heal()
        return win, refs

    eager, e_refs = fresh("eager")
    shared, s_refs = fresh("latency-shared")
    assert not any(shared.slot(r).provisional for r in shared.refs)
    assert all(torch.equal(a, b) for x, y in zip(kv_of(eager), kv_of(shared)) for a, b in zip(x, y))
    e_win, e_rc = op(eager, e_refs)
    s_win, s_rc = op(shared, s_refs)
    assert s_rc.forwards == 0
    s_win.heal()
    for (k1, v1), (k2, v2) in zip(kv_of(e_win), kv_of(s_win)):
        assert torch.allclose(k1, k2, atol=1e-6, rtol=0) and torch.allclose(v1, v2, atol=1e-6, rtol=0)
