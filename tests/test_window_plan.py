"""The plan a live window records (``window/plan.py``): the operations it executed, key-only, on
each receipt. Checked against the window's own measurements: the backend's forward and token
counters, the chunks' and patches' bytes, the store's tiers."""

from __future__ import annotations

import pytest

from contextdeque.stores import HostTier, MemoryTier
from contextdeque.window import ContextWindow
from contextdeque.window.plan import (COUNTS, Clear, Encode, Form, Forward, Keep, Load, Plan, Reuse, plan_totals,
                                      stored_bytes)


def _window(backend, policy: str = "eager") -> ContextWindow:
    backend.root_kv()
    store = [MemoryTier("cpu", None, name="device"), HostTier(None, name="host")]
    # (anticipation off: these plans are the operations' own, with no idle work prepared ahead)
    return ContextWindow(backend, rank=4, patch_policy=policy, store=store, anticipate=False)


def _ids(n: int, base: int) -> list[int]:
    return [base + i for i in range(n)]


def test_each_operation_counts_what_it_runs():
    """The counts are the receipt's meaning of them: an orbit patch of 3 orderings prefills its
    chunk three times; a store hit, a keep, a load prefill nothing."""
    assert Encode("b", 7, nbytes=10).counts() == {"forwards": 1, "tokens_prefilled": 7, "encodes": 1}
    assert Form("b", 7, kind="orbit", forwards=3, nbytes=5).counts() == {"forwards": 3, "tokens_prefilled": 21, "patches_formed": 1}
    assert Forward("b", 7, context=9).counts() == {"forwards": 1, "tokens_prefilled": 7}
    plan = Plan([Encode("a", 4, tier="device", nbytes=10), Form("b", 7, nbytes=5), Reuse("b", 7), Keep("a", 4),
                 Clear("a", 4), Load("a", 4, tier="host", nbytes=10)])
    assert plan.totals() == {"forwards": 2, "tokens_prefilled": 11, "encodes": 1, "patches_formed": 1, "patches_reused": 1}
    assert set(plan.totals()) == set(COUNTS)
    assert plan.stored() == {"device": 15}  # a load moves bytes, it stores none


def test_the_receipts_plan_is_what_the_window_ran(tiny_backend_factory, one_thread):
    backend = tiny_backend_factory("llama")
    win = _window(backend)
    a = win.append(token_ids=_ids(6, 10))
    b = win.append(token_ids=_ids(5, 40))
    ops = a.receipt.plan + b.receipt.plan
    # the first chunk has nothing in front: it keeps its canonical (exact there)
    assert [type(op).__name__ for op in ops] == ["Encode", "Keep", "Encode", "Form"]
    enc, form = ops[2], ops[3]
    assert (enc.chunk, enc.tokens, enc.tier) == (b.chunk_id, 5, "device")
    assert (form.chunk, form.antecedents, form.kind, form.forwards, form.tier) == (b.chunk_id, (a.chunk_id,), "exact", 1, "device")
    slots = {s.ref: s for s in win._state.slots}
    assert enc.nbytes == slots[b].chunk.nbytes and form.nbytes == slots[b].stack[0].patch.nbytes
    for r in (a.receipt, b.receipt):  # the plan's totals are the backend's own counters
        assert {k: plan_totals(r.plan)[k] for k in ("forwards", "tokens_prefilled", "encodes")} == {
            "forwards": r.forwards, "tokens_prefilled": r.tokens_prefilled, "encodes": r.encodes}
    assert stored_bytes(ops) == {"device": enc.nbytes + ops[0].nbytes + form.nbytes}


def test_a_recall_from_a_slower_tier_is_a_load(tiny_backend_factory, one_thread):
    """Evicting demotes the canonical one tier (no other holder); the recall reads it back: a
    ``Load`` of its bytes from ``host``, and a recall patch served by the store (the patch it was
    first formed with, on the same antecedent), no forward."""
    backend = tiny_backend_factory("llama")
    win = _window(backend)
    win.append(token_ids=_ids(6, 10))
    b = win.append(token_ids=_ids(5, 40))
    win.evict(b)
    r = win.recall(b)
    loads = [op for op in r.plan if isinstance(op, Load)]
    assert [(op.chunk, op.tier) for op in loads][:1] == [(b.chunk_id, "host")]
    assert loads[0].nbytes == {s.ref: s for s in win._state.slots}[b].chunk.nbytes
    assert r.forwards == 0 and plan_totals(r.plan)["forwards"] == 0
    assert [type(op).__name__ for op in r.plan if not isinstance(op, Load)] == ["Reuse"]


@pytest.mark.parametrize("policy", ["latency", "latency-shared"])
def test_latency_first_plans_a_forward_then_heals(tiny_backend_factory, one_thread, policy):
    """New content behind the window is one ``Forward`` (no canonical); the heal's plan holds what
    that policy computes in idle time, and the receipts' counters agree with the plans."""
    backend = tiny_backend_factory("llama")
    win = _window(backend, policy)
    win.append(token_ids=_ids(6, 10))
    b = win.append(token_ids=_ids(5, 40))
    # its KV is exact where it stands: it keeps it, queued for the heal
    assert [type(op).__name__ for op in b.receipt.plan] == ["Forward", "Keep"]
    assert b.receipt.plan[0].context == 6 and b.receipt.plan[1].deferred
    heal = win.heal()
    kinds = [type(op).__name__ for op in heal.plan]
    if policy == "latency-shared":  # the canonical, and its patch taken from the forward's KV (no forward)
        assert kinds[:2] == ["Encode", "Difference"]
    else:  # exact where it stands: nothing to do until something re-reads it
        assert "Encode" not in kinds
    assert plan_totals(heal.plan)["forwards"] == heal.forwards
