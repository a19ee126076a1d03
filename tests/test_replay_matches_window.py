"""The replay models the window it claims to model: on the same trace, the cost model's predicted
forwards, prefilled tokens and encodes equal the live window's receipts, for every reuse rule that
prices a window policy (``ReuseCost.window_policy``) under every placement.

The three agents' generated traces, scaled to a tiny random-weight model (the window's decisions
depend on keys, prefixes and the store, not on the weights); the live window is driven by the one
trace executor (``replay/live.py``) and heals at every step, as the cost model assumes. Queries
are the replay's own charges (one forward of the query's tokens each): the window does not run
them, so they are not part of the replay's plan.

With anticipation on (the window's default, ``WindowConfig.anticipate``) every step is also the
idle time in which the window prepares what comes next (the next slide's canonical, the recall
predictor's chains, likely reorders: ``window.anticipation``); the replay plans the same work with
the window's own predictor and planners over keys (``replay/anticipate.py``) and must price
exactly what the live window formed.

Both sides record their decisions as one key-only plan (``window.plan``): the window on its
receipts (what it executed), the replay as it prices them. The plans' totals are computed by the
same code, and bytes per tier are the KV each stores (canonicals encoded, patches formed) in the
tier it writes them to (docs/replay.md).

Both run the one tier policy (``TieredStore``: the live window over memory tiers, the replay over
key tiers, ``stores/keytier.py``) on a device / host / disk stack: the bytes each tier reads,
writes and evicts (``TierTraffic``; spills, copy-up promotions and the demotion of what no slot
holds any more included) must be equal too; ``TIGHT`` budgets make the tiers spill.
"""

from __future__ import annotations

from typing import Any

import pytest

from collections import Counter

from contextdeque.replay import ReplayConfig, Replayer
from contextdeque.replay.cost import CostModel
from contextdeque.replay.fidelity import trace_chunk_ids
from contextdeque.replay.live import drive_window
from contextdeque.replay.reuse import REUSE_COSTS
from contextdeque.traces import generate, scaled_trace
from contextdeque.traces.builder import TraceBuilder, content_hash
from contextdeque.traces.events import TraceHeader
from contextdeque.traces.io import Trace
from contextdeque.stores import MemoryTier, TieredStore
from contextdeque.window import ContextWindow
from contextdeque.window.healing import HealBudget, HealTask, heal_batch, heal_need, plan_heal_step
from contextdeque.window.plan import Plan, plan_totals, stored_bytes
from contextdeque.window.placement import PLACEMENT_POLICIES, make_placement

WINDOW_RULES = sorted(name for name, rule in REUSE_COSTS.items() if rule.window_policy is not None)
# an offline placement reads the trace's future: the replay has it, a live window does not.
# "valid" (recall_placement's default) as a window's placement puts entering chunks where a stored
# patch stays valid, often in front of residents: a recall's cascade then reaches chunks something
# was inserted before (the live window re-forms them as the replay does)
ONLINE_PLACEMENTS = sorted(name for name in PLACEMENT_POLICIES if not getattr(make_placement(name), "offline", False))
RANK = 8
SCALE = 1 / 64
BUDGET = 94  # tokens of the scaled traces (about 6,000 of the generated ones)
UNBOUNDED = 1 << 40  # bytes: a tier that never spills
# device and host bytes that make the tiers spill on every trace (the tiny model's KV: 1 KiB a token)
TIGHT = (60_000, 200_000)


def _idle_tokens(rate: float | None):
    """An idle rate (prefilled tokens per ms of the trace's idle gaps) as both executors take it."""
    return None if rate is None else (lambda ms: int(ms * rate))


def _tiers(tiers: tuple[int, int]) -> TieredStore:
    """The live window's store: device, host and disk tiers (``tiers``: the device and host bytes)."""
    return TieredStore([MemoryTier("cpu", tiers[0], name="device"), MemoryTier("cpu", tiers[1], name="host"),
                        MemoryTier("cpu", None, name="disk")])


def _window_receipt(backend, trace, placement: str, policy: str, budget: int | None = None, anticipate: bool = False,
                    idle_rate: float | None = None, charges: dict | None = None,
                    tiers: tuple[int, int] = (UNBOUNDED, UNBOUNDED)):
    store = _tiers(tiers)
    win = ContextWindow(backend, rank=RANK, placement=placement, patch_policy=policy, beyond_trained=True,
                        budget_tokens=budget, store=store, anticipate=anticipate,
                        **(charges or {}))
    ids = trace_chunk_ids(backend, trace)
    live = drive_window(win, trace, lambda ev: ids[ev.id], idle_tokens=_idle_tokens(idle_rate))
    t = store.total_traffic
    return live, {"read": t.read, "written": t.written, "evicted": t.evicted}


def _replay_plan(backend, trace, placement: str, rule: str, budget: int | None = None,
                 anticipate: bool = False, idle_rate: float | None = None, charges: dict | None = None,
                 tiers: tuple[int, int] = (UNBOUNDED, UNBOUNDED)) -> tuple[Plan, dict]:
    cost = CostModel.geometry_of(backend, storage_bytes=4, rank=RANK)
    plan = Plan()
    config = ReplayConfig(rank=RANK, budget_tokens=budget, anticipate=anticipate, device_bytes=tiers[0], host_bytes=tiers[1])
    r = Replayer(trace, placement, "lru", rule, cost, config, plan=plan, idle_tokens=_idle_tokens(idle_rate),
                 **(charges or {})).run()
    queries = [e for e in trace.events if e.op == "query"]
    totals = {"forwards": r.forwards - len(queries), "tokens_prefilled": r.tokens_prefilled - sum(q.tokens for q in queries),
              "encodes": r.encodes}
    return plan, {**totals, "stored": dict(r.stored), "traffic": r.traffic, "bytes": r.bytes}


def _costly(plan) -> Counter:
    """The plan's operations that cost a forward or store bytes, by type, size and forwards."""
    return Counter((type(op).__name__, op.tokens, op.counts().get("forwards", 0)) for op in plan
                   if op.counts().get("forwards") or op.stored())


def test_the_rules_and_placements_cover_the_window():
    """Guards the parametrization: the four window policies and the three online placements."""
    assert WINDOW_RULES == ["blind", "patch", "patch-latency", "patch-latency-shared"]
    assert ONLINE_PLACEMENTS == ["arrival", "scheduler", "valid"]


def _check(backend, kind: str, rule: str, placement: str, budget: int | None = None, anticipate: bool = False,
           seed: int = 0, idle_rate: float | None = None, charges: dict | None = None,
           tiers: tuple[int, int] = (UNBOUNDED, UNBOUNDED)) -> dict:
    """Returns the live store's traffic (what each tier read, wrote and evicted). ``charges``: what
    the idle budget charges (``factorization_cost`` / ``factorization_fixed`` / ``forward_fixed``,
    the window's options and the replay's arguments alike)."""
    backend.root_kv()  # the root's one prefill is the backend's, not the trace's
    trace = scaled_trace(generate(kind, seed=seed), SCALE, minimum=2)
    live, traffic = _window_receipt(backend, trace, placement, REUSE_COSTS[rule].window_policy, budget, anticipate,
                                    idle_rate, charges, tiers)
    plan, predicted = _replay_plan(backend, trace, placement, rule, budget, anticipate, idle_rate, charges, tiers)
    replayed_traffic, replayed_bytes = predicted.pop("traffic"), predicted.pop("bytes")
    executed = plan_totals(live.plan)
    # the window's plan is what it ran: its totals are the backend's own counters
    assert {k: executed[k] for k in ("forwards", "tokens_prefilled", "encodes")} == {
        "forwards": live.forwards, "tokens_prefilled": live.tokens_prefilled, "encodes": live.encodes}
    assert predicted == {"forwards": live.forwards, "tokens_prefilled": live.tokens_prefilled, "encodes": live.encodes,
                         "stored": stored_bytes(live.plan)}
    assert plan_totals(plan)["forwards"] == live.forwards
    assert _costly(plan) == _costly(live.plan)  # the same operations on chunks of the same sizes
    assert live.forwards > 0 and stored_bytes(live.plan).get("device", 0) > 0
    # bytes per tier: what each tier read, wrote and evicted (the live store's record)
    assert replayed_traffic == traffic
    assert replayed_bytes == {t: traffic["read"].get(t, 0) + traffic["written"].get(t, 0) for t in ("device", "host", "disk")}
    return traffic


@pytest.mark.parametrize("anticipate", [False, True], ids=["queued-only", "anticipating"])
@pytest.mark.parametrize("placement", ONLINE_PLACEMENTS)
@pytest.mark.parametrize("rule", WINDOW_RULES)
@pytest.mark.parametrize("kind", ["doc", "web", "video"])
def test_replay_predicts_the_live_windows_forwards_and_tokens(tiny_backend_factory, one_thread, kind, rule, placement,
                                                               anticipate):
    """``anticipating``: the window's default settings (``anticipate=True``, the session predictor).
    (The doc trace under ``valid`` places recalls in front of residents: the placement judges a
    stored patch by the residents' KV states now and their staleness by the antecedents still in
    the window, as ``placement.window_index`` does; a recall's cascade compares the recalled
    chunk's new KV with the KV each dependent was formed on.)"""
    _check(tiny_backend_factory("llama"), kind, rule, placement, anticipate=anticipate)


@pytest.mark.parametrize("seed", [0, 2, 3])
@pytest.mark.parametrize("rule", ["patch", "patch-latency", "patch-latency-shared"])
@pytest.mark.parametrize("kind", ["doc", "web", "video"])
def test_replay_predicts_the_live_window_under_a_token_budget(tiny_backend_factory, one_thread, kind, rule, seed):
    """A budget slides the oldest chunks out (survivors left at the front drop their patches, a
    recall's cascade is judged on the conditioning before that slide, a fork's discard gives the
    parent back its owed front canonicals): the replay's window does what the live one does, eager
    or latency-first. (Seeds 2 and 3 held the cases the replay once got wrong: an identity reorder
    of stale survivors, a cascade through a cleared front survivor, a discarded fork.)"""
    _check(tiny_backend_factory("llama"), kind, rule, "arrival", BUDGET, seed=seed)


# (rule, anticipate) that spill under ``TIGHT``: the rules that store what they compute (a
# latency-first window that does not anticipate computes few canonicals), and the window's default
# (``patch-latency`` anticipating: its slide preparation computes the next front canonical)
TIGHT_CASES = [*((rule, a) for rule in ("patch", "patch-latency-shared") for a in (False, True)), ("patch-latency", True)]


@pytest.mark.parametrize(("rule", "anticipate"), TIGHT_CASES,
                         ids=[f"{r}-{'anticipating' if a else 'queued-only'}" for r, a in TIGHT_CASES])
@pytest.mark.parametrize("kind", ["doc", "web", "video"])
def test_replay_predicts_the_live_store_s_traffic_under_tight_tiers(tiny_backend_factory, one_thread, kind, rule,
                                                                     anticipate):
    """``TIGHT`` device and host budgets: the device spills into the host and the host into the
    disk, a hit below the device is copied up, a released entry is demoted; the replay's tier
    stack (the same ``TieredStore`` over key tiers, victims least recently used first) moves the
    same bytes through each tier, and spills did happen. (Doc under the window's default: the slide
    preparation is a window operation of its own, whose slot holds the difference it stored before
    the later preparations' puts spill it; the replay once held it only at the step's end, and
    promoted it back.)"""
    traffic = _check(tiny_backend_factory("llama"), kind, rule, "arrival", anticipate=anticipate, tiers=TIGHT)
    assert traffic["evicted"].get("device", 0) > 0 and traffic["evicted"].get("host", 0) > 0
    assert traffic["written"].get("disk", 0) > 0


# tighter still: a heal step's later puts spill a canonical it computed before the step ends
TIGHTER = (45_000, 100_000)


@pytest.mark.parametrize("kind", ["doc", "web", "video"])
def test_replay_holds_a_provisional_chunk_s_canonical_from_the_operation_that_computes_it(tiny_backend_factory,
                                                                                          one_thread, kind):
    """A provisional slot holds no canonical (``WindowState.held_keys``): the window holds it at the
    end of the heal step that computes it, and brings it back up when that step's later puts spilled
    it (doc: the 33-token image chunk's canonical, 34 KiB of a 45 KB device, pushed out by its own
    difference patch). The replay's pool once counted the claim from the chunk's arrival, so it
    never promoted it (and the patch stayed where the window's promotion evicts it)."""
    traffic = _check(tiny_backend_factory("llama"), kind, "patch-latency", "arrival", anticipate=True, tiers=TIGHTER)
    assert traffic["evicted"].get("device", 0) > 0 and traffic["evicted"].get("host", 0) > 0


# a device that holds the largest chunk's KV (37 tokens: 37,888 B) but not its entry (KV and source:
# 38,480 B), which the store then puts into the host
BELOW_AN_ENTRY = (38_000, 60_000)


@pytest.mark.parametrize("kind", ["doc", "web", "video"])
def test_replay_records_an_entry_the_device_cannot_take_in_the_tier_it_lands_in(tiny_backend_factory, one_thread,
                                                                                kind):
    """The window's plan records a stored canonical or patch in the tier the put left it in
    (``WindowStore.tier_of``), the replay's in the tier its pool's put did: the host for web's
    37-token chunks on a 38 KB device (the replay once wrote them all to the device's account)."""
    _check(tiny_backend_factory("llama"), kind, "patch", "arrival", tiers=BELOW_AN_ENTRY)


@pytest.mark.parametrize("kind", ["doc", "web", "video"])
def test_replay_predicts_the_live_anticipating_window_under_a_token_budget(tiny_backend_factory, one_thread, kind):
    """Anticipation under a budget: each simulated recall slides the window as the recall would.
    (Doc seed 0, the third hinted chain of step 29: a recall to the front behind the budget's
    slide puts in the cascade the provisional chunks that ran after the recalled chunk's old KV, 5
    prepared re-forwards; web: a discarded fork gives the parent back the place of a canonical its
    slide let go before one was computed.)"""
    _check(tiny_backend_factory("llama"), kind, "patch-latency", "arrival", BUDGET, anticipate=True)


# (an eager window that does not anticipate spends no idle time: not a case)
IDLE_CASES = [("patch", True), *((rule, a) for rule in ("patch-latency", "patch-latency-shared") for a in (False, True))]


# idle rate (tokens per ms), per-token and per-patch factorization charges and the per-forward
# charge (prefill tokens)
IDLE_RATES = {"tight": (0.05, 0.0, 0.0, 0.0), "roomy": (0.5, 0.0, 0.0, 0.0), "priced": (0.5, 0.5, 0.0, 0.0),
              "per-patch": (0.5, 0.0, 24.0, 0.0), "split": (0.5, 0.25, 12.0, 0.0), "per-forward": (0.5, 0.25, 12.0, 6.0)}


@pytest.mark.parametrize("rate", sorted(IDLE_RATES))
@pytest.mark.parametrize(("rule", "anticipate"), IDLE_CASES, ids=[f"{r}-{'anticipating' if a else 'queued-only'}" for r, a in IDLE_CASES])
@pytest.mark.parametrize("kind", ["doc", "web", "video"])
def test_replay_heals_within_the_trace_s_idle_gaps_as_the_window_does(tiny_backend_factory, one_thread, kind, rule,
                                                                      anticipate, rate):
    """With an idle rate both executors heal a step within ``rate`` x its idle gap prefilled tokens
    (``healing.HealBudget``): the window's heal steps in ``heal_batch``'s order (the stalest pending
    chunk and those in front of it) until the budget is spent, then anticipation on what is left
    (under a budget the predictions ranked by cost, a too-dear one skipped); the replay prices the
    same steps. (An eager window queues nothing: only its anticipation draws on the budget.)
    ``priced``: the budget also charges each patch's factorization (``factorization_cost``, l21b),
    in the steps' costs and in anticipation's estimates; ``per-patch`` / ``split``: a fixed charge
    per patch factorized (``factorization_fixed``, issue 21), alone and beside the per-token one;
    ``per-forward``: besides, a fixed charge per forward (``forward_fixed``: a forward's fixed
    part, ``CostModel.forward_fixed_s``), in the steps' costs and in every estimate."""
    idle_rate, svd, fixed, per_forward = IDLE_RATES[rate]
    _check(tiny_backend_factory("llama"), kind, rule, "arrival", anticipate=anticipate, idle_rate=idle_rate,
           charges={"factorization_cost": svd, "factorization_fixed": fixed, "forward_fixed": per_forward})


def _built(steps) -> "Trace":
    tb = TraceBuilder(TraceHeader(generator="test", agent="doc", seed=0))
    for op, *args in steps:
        getattr(tb, op)(*args)
    return tb.build("built")


def _chunks(*spec):
    return [("arrive", cid, n, content_hash(cid)) for cid, n in spec]


# the heal decides as the window's eager policy would have on the slot as it was deferred: a pure
# permutation of what a slot carried heals with an orbit patch (one forward per ordering)
HEAL_CASES = {
    "reorder-a-permutation": [*_chunks(("a", 5), ("b", 4), ("c", 6)), ("step",), ("slide", 1), ("recall", "a"), ("step",),
                              ("reorder", ["b", "a", "c"]), ("step",), ("reorder", ["a", "b", "c"]), ("step",)],
    "recall-to-the-front": [*_chunks(("a", 5), ("b", 4), ("c", 6)), ("step",), ("evict", "a"), ("step",), ("recall", "a", 0),
                            ("step",), ("reorder", ["c", "b", "a"]), ("step",), ("reorder", ["b", "c", "a"]), ("step",)],
}


@pytest.mark.parametrize("rule", WINDOW_RULES)
@pytest.mark.parametrize("case", sorted(HEAL_CASES))
def test_replay_heals_as_the_window_does(tiny_backend_factory, one_thread, case, rule):
    backend = tiny_backend_factory("llama")
    backend.root_kv()
    trace = _built(HEAL_CASES[case])
    live, traffic = _window_receipt(backend, trace, "arrival", REUSE_COSTS[rule].window_policy)
    plan, predicted = _replay_plan(backend, trace, "arrival", rule)
    assert (predicted["forwards"], predicted["tokens_prefilled"]) == (live.forwards, live.tokens_prefilled)
    assert predicted["traffic"] == traffic
    assert _costly(plan) == _costly(live.plan)


# anticipation of a named reorder that brings new content (no canonical yet) to the front: its
# canonical is made where it stands first ("canonical" preparation), then the order's patches
ANTICIPATION_CASES = {
    "named-reorder-to-the-front": [*_chunks(("a", 5), ("b", 4), ("c", 6), ("d", 3)), ("step",),
                                   ("expect_order", ["c", "a", "b", "d"]), ("step",), ("reorder", ["c", "a", "b", "d"]),
                                   ("step",), ("expect_order", ["d", "c", "a", "b"]), ("step",),
                                   ("reorder", ["d", "c", "a", "b"]), ("step",)],
}


@pytest.mark.parametrize("rule", ["patch-latency", "patch-latency-shared"])
@pytest.mark.parametrize("case", sorted(ANTICIPATION_CASES))
def test_replay_anticipates_as_the_window_does(tiny_backend_factory, one_thread, case, rule):
    backend = tiny_backend_factory("llama")
    backend.root_kv()
    trace = _built(ANTICIPATION_CASES[case])
    live, traffic = _window_receipt(backend, trace, "arrival", REUSE_COSTS[rule].window_policy, anticipate=True)
    plan, predicted = _replay_plan(backend, trace, "arrival", rule, anticipate=True)
    assert (predicted["forwards"], predicted["tokens_prefilled"]) == (live.forwards, live.tokens_prefilled)
    assert predicted["traffic"] == traffic
    assert _costly(plan) == _costly(live.plan)


def test_a_trace_s_distinct_contents_get_distinct_tokens(tiny_backend_factory, one_thread):
    """The window names a chunk by its tokens, the trace by its content hash: two contents given the
    same token ids are one chunk to the window (one canonical stored, found by the second), two to
    the replay (the default model's video trace: ``seg4.f1`` and ``seg9.f2`` cut the same 5 tokens
    out of real text, one encode apart). ``trace_chunk_ids`` keeps distinct contents distinct."""
    backend = tiny_backend_factory("llama")
    backend.root_kv()
    trace = scaled_trace(generate("video", seed=0), SCALE, minimum=2)
    ids = trace_chunk_ids(backend, trace)
    assert trace.chunks["seg4.f1"].tokens == trace.chunks["seg9.f2"].tokens
    collided = {**ids, "seg9.f2": ids["seg4.f1"]}
    win = ContextWindow(backend, rank=RANK, placement="arrival", patch_policy="eager", beyond_trained=True,
                        store=[MemoryTier("cpu", None, name="device")], anticipate=False)
    live = drive_window(win, trace, lambda ev: collided[ev.id])
    _, predicted = _replay_plan(backend, trace, "arrival", "patch")
    assert predicted["encodes"] == live.encodes + 1  # the collision's one encode, as on the default model

    class Periodic:  # a corpus that repeats every 7 tokens: short chunks collide
        name = "periodic"

        @staticmethod
        def tokenizer(text, add_special_tokens=False):
            return {"input_ids": [10 + i % 7 for i in range(5000)]}

    short = TraceBuilder(TraceHeader(generator="test", agent="doc", seed=0))
    for cid in ("a", "b", "c", "d"):
        short.arrive(cid, 3, content_hash(cid))
    short.arrive("a2", 3, content_hash("a"))  # the same content again: the same tokens
    got = trace_chunk_ids(Periodic, short.build("periodic"))
    assert len({tuple(v) for k, v in got.items() if k != "a2"}) == 4 and got["a2"] == got["a"]


def test_heal_planning_is_over_keys():
    """``heal_batch`` / ``HealBudget``: the one plan both executors follow. A step heals the stalest
    pending chunk (the frontmost of equal ones) with the pending ones in front of it; the budget
    is checked between steps (the step that crosses it completes) and a preparation must fit."""
    order = ["a", "b", "c", "d", "e"]
    stale = {"b": 0.5, "c": 1.0, "d": 0.2, "e": 1.0}
    assert heal_batch(order, {"b", "c", "d", "e"}, stale.__getitem__) == ["b", "c"]
    assert heal_batch(order, {"d", "e"}, stale.__getitem__) == ["d", "e"]
    assert heal_batch(order, {"b", "e"}, stale.__getitem__, target="b") == ["b"]
    assert heal_batch(order, set(), stale.__getitem__) == []
    budget = HealBudget(max_tokens=10)
    assert budget.allows_step() and budget.fits(10) and not budget.fits(11) and budget.fits(None)
    budget.spend(12)  # a step may overshoot: the next one is refused, and nothing more fits
    assert not budget.allows_step() and not budget.fits(0) and budget.bounded
    assert HealBudget(max_steps=1).allows_step() and not HealBudget(max_steps=1).bounded


def test_heal_step_plan_is_over_keys():
    """``plan_heal_step`` / ``heal_need``: what each chunk of a step needs, decided once for both
    executors (the window's ``_heal_step`` runs it, the replay's heal prices it). A provisional
    chunk gets its canonical at the front or without lazy canonicals; under lazy canonicals it
    keeps its forward where it was appended, or is re-forwarded when the eager policy would
    re-condition it; a chunk with a canonical is re-conditioned. Nothing pending: one departed
    chunk's canonical."""
    assert heal_need(0, True, True, True) == "canonical"
    assert heal_need(2, True, False, False) == "canonical"
    assert heal_need(2, True, True, False) == "keep"
    assert heal_need(2, True, True, True) == "reforward"
    assert heal_need(2, False, True, True) == heal_need(0, False, False, False) == "recondition"
    order = ["a", "b", "c", "d"]
    provisional = {"a": True, "b": False, "c": True, "d": True}
    requeued = {"c"}
    need = lambda k, i: heal_need(i, provisional[k], True, k in requeued)  # noqa: E731
    stale = {"a": 0.1, "b": 0.2, "c": 0.9, "d": 0.3}.__getitem__
    assert plan_heal_step(order, {"a", "b", "c", "d"}, stale, need) == [
        HealTask("a", "canonical", ()), HealTask("b", "recondition", ("a",)), HealTask("c", "reforward", ("a", "b"))]
    assert plan_heal_step(order, {"d"}, stale, need) == [HealTask("d", "keep", ("a", "b", "c"))]
    assert plan_heal_step(order, set(), stale, need, departed=["x", "y"]) == [HealTask("x", "departed")]
    assert plan_heal_step(order, set(), stale, need) == []
