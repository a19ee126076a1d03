"""Anticipatory healing (window.anticipation): heal() prepares the next likely re-reads, which then
run no forward and equal the eager policy's window; with anticipation off heal is as before, and
an anticipation the window has moved past is never served."""

from __future__ import annotations

import pytest
import torch
from helpers import POOL, build_pool_window, micro_llama_backend_fixture, pool_answer_logits

from contextdeque.core.errors import WindowError, WindowTypeError
from contextdeque.core.metrics import kl_divergence
from contextdeque.window import ContextWindow
from contextdeque.window.anticipation import recall_candidates
from contextdeque.window.config import WindowConfig

backend = micro_llama_backend_fixture(7, "tiny-anticipation-llama")
answer_logits = pool_answer_logits


def build(backend, policy, *, anticipate=False, provisional=False, budget=22):
    """:func:`helpers.build_pool_window`: the first page slid out (the recall candidate)."""
    win, refs = build_pool_window(backend, policy, anticipate=anticipate, provisional=provisional, budget=budget)
    assert refs[0] not in win.refs
    return win, refs


STEPS = {
    "slide": lambda w, refs: w.slide(1),
    "recall": lambda w, refs: w.recall(refs[0], at="end"),
    "look-back": lambda w, refs: w.recall(refs[0], at=0),
}


@pytest.mark.parametrize("step", sorted(STEPS))
def test_anticipated_step_runs_no_forward_and_equals_eager(backend, step):
    plain, refs_p = build(backend, "eager")  # no anticipation: what the step costs without it
    eager, refs_e = build(backend, "eager", anticipate=True)  # the same settings, the eager policy
    fast, refs_f = build(backend, "latency", anticipate=True)
    r_plain = STEPS[step](plain, refs_p)
    STEPS[step](eager, refs_e)
    r_fast = STEPS[step](fast, refs_f)
    assert r_fast.forwards == 0
    assert not r_fast.deferred and not fast.pending_refs  # nothing served stale or blind
    if step == "recall":  # the eager policy forms patches there: anticipation had them ready
        assert r_plain.forwards > 0 and r_plain.patches_formed > 0
        assert r_fast.served and all(what == "anticipated" for _, what in r_fast.served)
    else:  # at the front the canonical is exact: the eager policy forms nothing either
        assert r_plain.forwards == 0
    # (a look-back lands in front of survivors: anticipation had their exact patches on the new
    # prefix ready, where the eager policy without it keeps their patches as they are)
    assert kl_divergence(answer_logits(backend, eager), answer_logits(backend, fast)) <= 1e-6


def test_anticipation_off_heals_as_before(backend):
    """anticipate=False: heal does only the queued work (no anticipation step, nothing formed
    ahead), and the recall of the page that left is served blind and deferred, as the latency
    policy serves it without anticipation; the window equals one built with heal's queued work
    only (``max_steps`` bounded to it). On is the default: the same recall is served prepared."""
    off, refs_o = build(backend, "latency", anticipate=False)
    # the oracle: anticipation on, but every heal bounded to the queued work (one step at a time,
    # the last leaves anticipation no step), so nothing is ever prepared ahead
    queued = ContextWindow(backend, budget_tokens=22, rank=2, patch_policy="latency", anticipate=True)
    refs_q = []
    for p in POOL[:5]:
        refs_q.append(queued.append(chunk=backend.encode(token_ids=p)))
        while queued.pending_refs:
            queued.heal(max_steps=1)
    assert not off._ctx.anticipated_keys and not any(r.op == "anticipate" for r in off.receipts)
    assert not queued._ctx.anticipated_keys
    assert torch.equal(answer_logits(backend, queued), answer_logits(backend, off))
    r_off, r_q = off.recall(refs_o[0], at="end"), queued.recall(refs_q[0], at="end")
    assert r_off.forwards == r_q.forwards == 0
    assert r_off.deferred and [d[1:] for d in r_off.deferred] == [d[1:] for d in r_q.deferred]
    assert {what for _, what in r_off.served} <= {"blind", "stale"}
    assert torch.equal(answer_logits(backend, queued), answer_logits(backend, off))
    h_off = off.heal()  # the queued work only: no anticipation step
    while queued.pending_refs:
        queued.heal(max_steps=1)
    assert h_off.forwards > 0 and not any(r.op == "anticipate" for r in off.receipts)
    assert torch.equal(answer_logits(backend, queued), answer_logits(backend, off))
    assert WindowConfig().anticipate is True
    on, refs_on = build(backend, "latency", anticipate=None)  # the default
    r_on = on.recall(refs_on[0], at="end")
    assert r_on.forwards == 0 and not r_on.deferred and all(what == "anticipated" for _, what in r_on.served)
    with pytest.raises(WindowTypeError):
        WindowConfig(anticipate=1)


def test_stale_anticipation_is_not_served(backend):
    """The context changed after the anticipation was formed (another page appended, one more
    slid out): the recall lands in another arrangement, the anticipated patch's key differs, and
    the recall is served as without anticipation (deferred), never the anticipated patch."""
    win, refs = build(backend, "latency", anticipate=True)
    assert win._ctx.anticipated_keys  # heal formed some
    win.append(chunk=backend.encode(token_ids=POOL[5]))  # no heal: nothing anticipated for this arrangement
    r = win.recall(refs[0], at="end")
    assert r.forwards == 0 and r.patches_reused == 0
    assert "anticipated" not in {what for _, what in r.served}
    assert refs[0] in {ref for ref, _, _ in r.deferred}
    healed = win.heal()  # the eager policy's decisions, formed now
    assert healed.forwards > 0


def test_expect_prepares_that_recall_first(backend):
    win, refs = build(backend, "latency", anticipate=True)
    win.evict(refs[2])  # a middle page leaves; the agent says it will look at it again in front
    win.expect(refs[2], at=0)
    win.heal()
    r = win.recall(refs[2], at=0)
    assert r.forwards == 0 and not r.deferred


def test_provisional_page_reaching_the_front_is_exact(backend):
    """New content (no canonical): anticipation gives the page the next slide brings to the front
    its canonical, so the slide serves the exact canonical there as the eager policy does."""
    eager, refs_e = build(backend, "eager", provisional=True)
    fast, refs_f = build(backend, "latency", anticipate=True, provisional=True)
    r = fast.slide(1)
    eager.slide(1)
    assert r.forwards == 0
    front = fast.slot(fast.refs[0])
    assert not front.provisional and not front.stack  # the canonical: exact at the front
    assert torch.equal(front.chunk.keys, eager.slot(eager.refs[0]).chunk.keys)


def test_anticipation_skips_a_recall_the_budget_would_refuse(backend):
    """overflow='error': a recall that would not fit is refused, so heal prepares none (and does
    not raise); one that fits (after an eviction) is prepared."""
    win = ContextWindow(backend, budget_tokens=15, rank=2, patch_policy="latency", overflow="error", anticipate=True)
    refs = [win.append(chunk=backend.encode(token_ids=p)) for p in POOL[:3]]
    win.evict(refs[0])
    win.append(chunk=backend.encode(token_ids=POOL[4]))  # 6 + 4 + 3 = 13 of 15: refs[0] (5) no longer fits
    win.heal()
    assert not any(refs[0] in r.refs for r in win.receipts if r.op == "anticipate")  # (reorders may be prepared)
    win.evict(refs[2])
    win.heal()
    r = win.recall(refs[0], at="end")
    assert r.forwards == 0 and not r.deferred and r.served and all(w == "anticipated" for _, w in r.served)


def test_expected_group_is_prepared_as_one_sequence(backend):
    """Two chunks re-read together (expect([a, b])): the second recall lands on the arrangement the
    first leaves (here the budget also slides a page out for it); both find what heal prepared,
    run no forward and equal the eager policy doing the same."""
    def run(policy, anticipate):
        win, refs = build(backend, policy, anticipate=anticipate)
        win.evict(refs[2])
        if anticipate:
            win.expect([refs[0], refs[2]], at="end")
        win.heal()
        return win, [win.recall(refs[0], at="end"), win.recall(refs[2], at="end")]

    eager, r_eager = run("eager", False)
    fast, r_fast = run("latency", True)
    assert all(r.forwards > 0 for r in r_eager) and r_eager[1].left  # the eager policy forms both, and slides for the second
    for r in r_fast:
        assert r.forwards == 0 and not r.deferred
        assert r.served and all(what == "anticipated" for _, what in r.served)
    assert [r.chunk_id for r in r_fast[1].left] == [r.chunk_id for r in r_eager[1].left]
    assert kl_divergence(answer_logits(backend, eager), answer_logits(backend, fast)) <= 1e-6
    # one of them alone is not that sequence: without the hint, the second recall is deferred
    plain, refs = build(backend, "latency", anticipate=True)
    plain.evict(refs[2])
    plain.heal()
    plain.recall(refs[0], at="end")
    assert plain.recall(refs[2], at="end").deferred


@pytest.mark.parametrize("recall_placement", ["valid", None])
def test_expect_without_at_prepares_the_recall_where_recall_puts_it(backend, recall_placement):
    """``expect(ref)`` and ``recall(ref)`` mean the same place: wherever the window's recall
    placement puts the chunk (``valid``: behind the neighbours it was formed on, where its stored
    patch still applies; None: the end). The hint reaches the predictor as None (not "end"), the
    heal prepares that recall, and the recall runs no forward, served fresh."""
    def run(hint):
        win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=True, recall_placement=recall_placement)
        refs = [win.append(token_ids=p) for p in POOL[:4]]
        win.heal(anticipate=False)
        win.evict(refs[1])
        win.heal(anticipate=False)
        if hint:
            win.expect(refs[1])
            assert win.expected == {(refs[1],): None}
            ranked = recall_candidates(win, win._state)
            assert ranked[0].recalls == ((refs[1], None),) and ranked[0].source == "expected"
        win.heal()
        return win, refs, win.recall(refs[1])

    win, refs, r = run(True)
    assert r.forwards == 0 and r.answered_fresh and not r.deferred
    assert dict(r.served)[refs[1]] in ("anticipated", "recurring")
    plain, refs_p, r_plain = run(False)  # the same recall, placed by the same rule, without the hint
    assert [i for _, i, _ in r.placed] == [i for _, i, _ in r_plain.placed]
    if recall_placement is None:
        assert win.refs[-1] == refs[1]


def test_expect_refuses_an_at_recall_would_not_take(backend):
    win, refs = build(backend, "latency", anticipate=True)
    with pytest.raises(TypeError):
        win.expect(refs[0], at="front")
    with pytest.raises(TypeError):
        win.expect(refs[0], at=1.5)


def test_expect_refuses_what_is_not_a_ref(backend):
    win, refs = build(backend, "latency", anticipate=True)
    with pytest.raises(TypeError):
        win.expect(3)
    with pytest.raises(WindowError):
        win.expect([refs[0], refs[0]])
    with pytest.raises(WindowError):
        win.expect([])


def test_provisional_dependents_of_a_recall_take_the_prepared_reforward(backend):
    """Latency-first content has no canonical: when a recall puts a chunk behind the pages that
    were conditioned on it (the recall cascade), heal would re-forward them behind their new
    prefix. Anticipation runs those forwards in idle time; the recall takes them (0 forwards,
    nothing deferred) and holds exactly what the recall plus heal hold without anticipation."""
    def run(anticipate):
        win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=anticipate)
        # the second with its canonical (known content), the others provisional (new content:
        # one forward after those in front, no canonical)
        refs = [win.append(chunk=backend.encode(token_ids=p)) if i == 1 else win.append(token_ids=p)
                for i, p in enumerate(POOL[:4])]
        win.evict(refs[1])
        if anticipate:
            win.expect(refs[1], at="end")
            win.heal(max_tokens=10_000)  # (a budget: the front never left, so no slide is prepared)
        return win, refs, win.recall(refs[1], at="end")

    fast, refs, r = run(True)
    assert r.forwards == 0 and r.answered_fresh and not fast.pending_refs
    assert set(r.cascade.implied) == {refs[2], refs[3]}
    served = dict(r.served)
    assert served[refs[2]] == served[refs[3]] == served[refs[1]] == "anticipated"
    slow, _, r_slow = run(False)
    assert {what for _, what in r_slow.served} >= {"conditioned"} and slow.pending_refs
    slow.heal()
    assert kl_divergence(answer_logits(backend, slow), answer_logits(backend, fast)) <= 1e-6


def test_consecutive_prepared_reforwards_run_as_one_forward(backend):
    """The recall cascade's consecutive provisional dependents are re-forwarded by ONE forward of
    their concatenation (``ingest.reforward_run``: one forward's fixed cost, what loses a hinted
    recall under the H200's prices), each joined ``Forward`` in the plan, and the recall takes
    them as before (the test above holds its KV equal to the sequential heal's re-forwards)."""
    win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=True)
    refs = [win.append(chunk=backend.encode(token_ids=p)) if i == 1 else win.append(token_ids=p)
            for i, p in enumerate(POOL[:5])]
    win.evict(refs[1])
    win.expect(refs[1], at="end")
    before = backend.forwards_run
    win.heal(max_tokens=10_000)
    prepared = [r for r in win.receipts if r.op == "anticipate" and refs[1] in r.refs]
    assert len(prepared) == 1
    forwards = [op for op in prepared[0].plan if type(op).__name__ == "Forward"]
    # refs[2..4] behind refs[0]: one forward (two joined), then refs[1]'s patch behind them (one)
    assert [op.joined for op in forwards] == [False, True, True]
    assert prepared[0].forwards == 2 and backend.forwards_run - before >= 2
    r = win.recall(refs[1], at="end")
    assert r.forwards == 0 and r.answered_fresh and set(r.cascade.implied) == {refs[2], refs[3], refs[4]}


def test_a_reforward_run_is_run_once_when_the_prepared_bound_keeps_only_part_of_it(backend):
    """The pass takes what it re-forwarded ahead even where ``window.prepared``'s bound kept
    only the first of the run (one entry here): each provisional dependent is re-forwarded once,
    by the one forward of the run, not again when the pass reaches it."""
    win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=True)
    refs = [win.append(chunk=backend.encode(token_ids=p)) if i == 1 else win.append(token_ids=p)
            for i, p in enumerate(POOL[:5])]
    win.evict(refs[1])
    win.expect(refs[1], at="end")
    win._ctx.prepared.max_entries = 1
    win.heal(max_tokens=10_000)
    prepared = [r for r in win.receipts if r.op == "anticipate" and refs[1] in r.refs]
    assert len(prepared) == 1
    forwards = [op for op in prepared[0].plan if type(op).__name__ == "Forward"]
    assert [op.joined for op in forwards] == [False, True, True]


@pytest.mark.parametrize("mixed", [False, True], ids=["tokens", "tokens-and-embeddings"])
def test_a_reforward_run_equals_reforwarding_each_behind_the_one_before(backend, mixed):
    """``reforward_run``: one forward of consecutive provisional chunks gives each the KV that
    re-forwarding it behind the re-forwarded ones in front of it gives (causal attention), a
    run of token chunks and of token chunks beside an embeddings chunk alike."""
    from contextdeque.window import ingest
    from contextdeque.window.receipt import Meter

    win = ContextWindow(backend, rank=2, patch_policy="latency")
    for i, p in enumerate(POOL[:4]):
        if mixed and i == 2:
            win.append(embeds=backend.embed_tokens(torch.tensor(p)).float().cpu())
        else:
            win.append(token_ids=p)
    ctx, slots = win._ctx, list(win._state.slots)
    prefix, run = slots[:1], slots[1:]
    before = backend.forwards_run
    batched = ingest.reforward_run(ctx, run, prefix, Meter(ctx, "test"))
    assert backend.forwards_run - before == 1
    one_by_one: list = []
    for s in run:  # each behind the ones re-forwarded before it, placed (its page what the next attends to)
        front = [*prefix, *one_by_one]
        one_by_one.append(_placed(ctx, ingest.reforward(ctx, s, front, Meter(ctx, "test")), front))
    for a, b in zip(batched, one_by_one):
        assert a.chunk.id == b.chunk.id and a.version == b.version
        torch.testing.assert_close(a.chunk.keys, b.chunk.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.chunk.values, b.chunk.values, rtol=1e-4, atol=1e-4)


def _placed(ctx, slot, prefix):
    from contextdeque.window.decode import next_position
    from contextdeque.window.reconcile import place
    from contextdeque.window.receipt import Meter

    return place(ctx, slot, next_position(ctx, prefix), slot.stack, Meter(ctx, "test"))


def test_a_canonical_an_earlier_preparation_stored_is_not_priced_again(backend):
    """A chunk evicted before its canonical was computed owes it (a recall encodes it); once a
    preparation (simulated on a copy: the entry still owes it) stored it, the recall finds it and
    the predictions' estimates no longer charge its encode (they did, and a gap's hinted chain
    then did not fit on the H200's prices)."""
    from contextdeque.window.predictor import chain_tokens

    win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=True)
    refs = [win.append(token_ids=p) for p in POOL[:4]]
    win.evict(refs[2])
    entry = win._state.evicted[refs[2]]
    assert entry.owes_encode and not win._ctx.store.has(entry.chunk_key)
    before = next(p for p in recall_candidates(win, win._state) if p.recalls == ((refs[2], "end"),))
    win.expect(refs[2], at="end")
    win.heal(max_tokens=10_000)
    assert win._state.evicted[refs[2]].owes_encode and win._ctx.store.has(entry.chunk_key)
    after = next(p for p in recall_candidates(win, win._state) if p.recalls == ((refs[2], "end"),))
    assert chain_tokens(win._state, after.recalls)[0] == before.cost_tokens  # (the raw entry still owes it)
    assert after.cost_tokens == before.cost_tokens - entry.n_tokens
    r = win.recall(refs[2], at="end")
    assert r.encodes == 0 and r.forwards == 0  # (found, as the estimate now says)


def test_a_hinted_chain_too_dear_before_its_prefix_ran_is_offered_again(backend):
    """A hinted chain comes before its prefixes; too dear for what is left of a gap it is
    skipped, and once a prefix ran (its patches stored, often already by an earlier pass: it cost
    less than its estimate) the chain is offered again at the rest of its estimate (the last
    hinted recall of doc-1's gap, 144 tokens short when the prefix's estimate was paid twice)."""
    from contextdeque.window.anticipation import plan_anticipation
    from contextdeque.window.healing import IdlePrices

    win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=True)
    refs = [win.append(chunk=backend.encode(token_ids=p)) for p in POOL[:5]]
    for r in refs[2:]:
        win.evict(r)
    for r in refs[2:]:
        win.expect(r, at="end")
    chain = tuple((r, "end") for r in refs[2:])
    tasks = plan_anticipation(lambda: win._predicted(win._state), win.recall_predictor, win.expected, [], True,
                              IdlePrices(forward_fixed=10.0), None, lambda: [])
    offered, fits = [], None
    for task in tasks:
        if task.kind != "recalls":
            continue
        offered.append((task.recalls, task.cost))
        fits = task.cost - 1 if fits is None else fits  # (the first, the whole chain, does not fit)
        task.ran = task.cost <= fits
    whole = [cost for recalls, cost in offered if recalls == chain]
    prefix = next(cost for recalls, cost in offered if recalls == chain[:2])
    assert offered[0][0] == chain and len(whole) == 2 and whole[1] == whole[0] - prefix


def test_a_budget_prepares_the_likely_recall_not_a_slide_that_never_comes(backend):
    """Under an idle budget the next slide's canonical is prepared only when the front leaving is
    as likely as the best recall prediction: an agent that keeps its task in front and said what
    it re-reads gets that recall prepared (before: the slide's canonical took the budget first)."""
    win = ContextWindow(backend, rank=2, patch_policy="latency", anticipate=True)
    refs = [win.append(token_ids=p) for p in POOL[:4]]
    win.evict(refs[3])  # nothing depends on it: its own patch is the whole cost
    assert win.recall_predictor.p_front_leaves() < 0.5
    win.expect(refs[3], at="end")
    top = recall_candidates(win, win._state)[0]
    assert top.recalls == ((refs[3], "end"),)
    win.heal(max_tokens=top.cost_tokens)  # its canonical (it left without one) and its patch
    assert win._state.slots[1].provisional  # no canonical formed for a slide
    r = win.recall(refs[3], at="end")
    assert r.forwards == 0 and r.answered_fresh


def test_a_stored_patch_anticipation_only_found_is_recurring(backend):
    """Anticipation that finds a patch already stored (formed by an operation's heal) does not
    relabel it: a later step served it as "recurring"; what it formed itself is "anticipated"."""
    win = ContextWindow(backend, budget_tokens=22, rank=2, patch_policy="latency", anticipate=True)
    refs = []
    for p in POOL[:5]:  # as build(), but no heal anticipates yet
        refs.append(win.append(chunk=backend.encode(token_ids=p)))
        win.heal(anticipate=False)
    assert not win._ctx.anticipated_keys
    sibling = win.fork()
    sibling.recall(refs[0], at="end")
    healed = sibling.heal(anticipate=False)  # the eager policy's patches for that arrangement
    assert healed.patches_formed > 0
    sibling.discard()
    win.heal()  # anticipation: the recall at the end is the likeliest; its patches are stored already
    assert any(r.op == "anticipate" and r.patches_reused > 0 for r in win.receipts)  # (it found them)
    r = win.fork().recall(refs[0], at="end")
    assert r.forwards == 0 and not r.deferred and r.served
    assert {what for _, what in r.served} == {"recurring"}


def test_the_slide_anticipation_counts_the_patch_it_forms(backend):
    """New content: the canonical the next slide brings to the front comes with the patch that keeps
    the chunk where it stands (the difference to its provisional KV, no forward): counted in
    ``patches_formed`` like every patch in the receipt's plan, and remembered as anticipated."""
    from contextdeque.window.plan import Difference, Form

    win = ContextWindow(backend, budget_tokens=22, rank=2, patch_policy="latency", anticipate=True)
    for p in POOL[:3]:  # no slide: the second page still stands behind what it ran after
        win.append(token_ids=p)
    win.heal()
    slide = [r for r in win.receipts if r.op == "anticipate" and r.refs == (win.refs[1],)]
    assert slide and any(isinstance(op, Difference) for op in slide[0].plan)
    for r in win.receipts:
        assert r.patches_formed == sum(isinstance(op, (Form, Difference)) for op in r.plan), r
    assert win._ctx.anticipated_keys


def test_heal_without_anticipation_does_the_queued_work_only(backend):
    """``heal(anticipate=False)`` on a window with anticipation on: the queued work, nothing
    prepared ahead (the window equals one whose heals never anticipated); a later ``heal()``
    anticipates."""
    on, refs_on = build(backend, "latency", anticipate=True)
    off, refs_off = build(backend, "latency", anticipate=False)
    for win in (on, off):  # known content appended: its patch is queued (nothing anticipated an append)
        win.append(chunk=backend.encode(token_ids=POOL[5]))
    n = len(on.receipts)
    h = on.heal(anticipate=False)
    assert h.forwards > 0 and not any(r.op == "anticipate" for r in list(on.receipts)[n:])
    off.heal()
    assert torch.equal(answer_logits(backend, on), answer_logits(backend, off))
    assert on.anticipation_due
    on.heal()
    assert any(r.op == "anticipate" for r in list(on.receipts)[n:])
    with pytest.raises(WindowTypeError):
        on.heal(anticipate=1)


def test_prepared_forwards_keep_the_current_passs_best_over_earlier_passes():
    """The prepared re-forwards' bound (window.prepared, shared with the replay's mirror): a pass
    that prepares more than the bound holds keeps its first (best-ranked) entries and refuses the
    later ones; entries of earlier passes go first, oldest first; one a pass finds again belongs to
    it. (Dropping the oldest instead lost the best prediction's cascade on web-0 at an unbounded
    idle rate: its recalls were served blind.)"""
    from contextdeque.window.prepared import PreparedForwards

    kept = PreparedForwards(max_entries=3)
    kept.new_pass()
    assert all(kept.put(k, k, nbytes=1) for k in ("old1", "old2", "old3"))
    kept.new_pass()
    assert kept.get("old2") == "old2"  # found again by this pass: its own
    assert kept.put("best", "best", nbytes=1) and kept.put("next", "next", nbytes=1)
    assert "old1" not in kept and "old3" not in kept and "old2" in kept
    assert not kept.put("worst", "worst", nbytes=1)  # only this pass's left: the later one is not kept
    assert [k for k in ("old2", "best", "next", "worst") if k in kept] == ["old2", "best", "next"]
    by_bytes = PreparedForwards(max_bytes=10)
    by_bytes.new_pass()
    assert by_bytes.put("a", "a", nbytes=6) and not by_bytes.put("b", "b", nbytes=6) and by_bytes.nbytes == 6
