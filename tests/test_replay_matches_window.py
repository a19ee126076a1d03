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
"""

from __future__ import annotations

import pytest

from collections import Counter

from contextdeque.replay import ReplayConfig, Replayer
from contextdeque.replay.cost import CostModel
from contextdeque.replay.fidelity import chunk_ids
from contextdeque.replay.live import drive_window
from contextdeque.replay.reuse import REUSE_COSTS
from contextdeque.traces import generate, scaled_trace
from contextdeque.traces.builder import TraceBuilder, content_hash
from contextdeque.traces.events import TraceHeader
from contextdeque.traces.io import Trace
from contextdeque.stores import MemoryTier
from contextdeque.window import ContextWindow
from contextdeque.window.plan import Plan, plan_totals, stored_bytes
import contextdeque.scheduler  # noqa: F401  (registers the scheduler's placements)
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


def _window_receipt(backend, trace, placement: str, policy: str, budget: int | None = None, anticipate: bool = False):
    win = ContextWindow(backend, rank=RANK, placement=placement, patch_policy=policy, beyond_trained=True,
                        budget_tokens=budget, store=[MemoryTier("cpu", None, name="device")], anticipate=anticipate)
    return drive_window(win, trace, lambda ev: chunk_ids(backend, ev.hash, ev.tokens))


def _replay_plan(backend, trace, placement: str, rule: str, budget: int | None = None,
                 anticipate: bool = False) -> tuple[Plan, dict]:
    cost = CostModel.geometry_of(backend, storage_bytes=4, rank=RANK)
    plan = Plan()
    config = ReplayConfig(rank=RANK, budget_tokens=budget, anticipate=anticipate)
    r = Replayer(trace, placement, "lru", rule, cost, config, plan=plan).run()
    queries = [e for e in trace.events if e.op == "query"]
    totals = {"forwards": r.forwards - len(queries), "tokens_prefilled": r.tokens_prefilled - sum(q.tokens for q in queries),
              "encodes": r.encodes}
    return plan, {**totals, "stored": dict(r.stored)}


def _costly(plan) -> Counter:
    """The plan's operations that cost a forward or store bytes, by type, size and forwards."""
    return Counter((type(op).__name__, op.tokens, op.counts().get("forwards", 0)) for op in plan
                   if op.counts().get("forwards") or op.stored())


def test_the_rules_and_placements_cover_the_window():
    """Guards the parametrization: the four window policies and the three online placements."""
    assert WINDOW_RULES == ["blind", "patch", "patch-latency", "patch-latency-shared"]
    assert ONLINE_PLACEMENTS == ["arrival", "scheduler", "valid"]


def _check(backend, kind: str, rule: str, placement: str, budget: int | None = None, anticipate: bool = False,
           seed: int = 0) -> None:
    backend.root_kv()  # the root's one prefill is the backend's, not the trace's
    trace = scaled_trace(generate(kind, seed=seed), SCALE, minimum=2)
    live = _window_receipt(backend, trace, placement, REUSE_COSTS[rule].window_policy, budget, anticipate)
    plan, predicted = _replay_plan(backend, trace, placement, rule, budget, anticipate)
    executed = plan_totals(live.plan)
    # the window's plan is what it ran: its totals are the backend's own counters
    assert {k: executed[k] for k in ("forwards", "tokens_prefilled", "encodes")} == {
        "forwards": live.forwards, "tokens_prefilled": live.tokens_prefilled, "encodes": live.encodes}
    assert predicted == {"forwards": live.forwards, "tokens_prefilled": live.tokens_prefilled, "encodes": live.encodes,
                         "stored": stored_bytes(live.plan)}
    assert plan_totals(plan)["forwards"] == live.forwards
    assert _costly(plan) == _costly(live.plan)  # the same operations on chunks of the same sizes
    assert live.forwards > 0 and stored_bytes(live.plan).get("device", 0) > 0


# Not equal yet (known gaps, each must still fail: strict): the eager and latency-shared policies
# under the "valid" placement with anticipation on, on the doc trace (valid places appends in front
# of residents; the simulated recalls of anticipation then part from the live window's).
KNOWN_GAPS = {("doc", "patch", "valid", True), ("doc", "patch-latency-shared", "valid", True)}


@pytest.mark.parametrize("anticipate", [False, True], ids=["queued-only", "anticipating"])
@pytest.mark.parametrize("placement", ONLINE_PLACEMENTS)
@pytest.mark.parametrize("rule", WINDOW_RULES)
@pytest.mark.parametrize("kind", ["doc", "web", "video"])
def test_replay_predicts_the_live_windows_forwards_and_tokens(tiny_backend_factory, one_thread, kind, rule, placement,
                                                               anticipate, request):
    """``anticipating``: the window's default settings (``anticipate=True``, the session predictor)."""
    if (kind, rule, placement, anticipate) in KNOWN_GAPS:
        request.applymarker(pytest.mark.xfail(strict=True, reason="known gap: see KNOWN_GAPS"))
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


@pytest.mark.parametrize("kind", [pytest.param("doc", marks=pytest.mark.xfail(strict=True, reason="known gap")),
                                  pytest.param("web", marks=pytest.mark.xfail(strict=True, reason="known gap")), "video"])
def test_replay_predicts_the_live_anticipating_window_under_a_token_budget(tiny_backend_factory, one_thread, kind):
    """Anticipation under a budget: each simulated recall slides the window as the recall would.
    (Known gap on doc and web: a chain under the budget's slide where the live window prepares
    re-forwards of provisional residents that the replay's simulation does not reach; doc seed 0,
    the third hinted chain of step 29: 5 re-forwards, 86 tokens.)"""
    _check(tiny_backend_factory("llama"), kind, "patch-latency", "arrival", BUDGET, anticipate=True)


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
    live = _window_receipt(backend, trace, "arrival", REUSE_COSTS[rule].window_policy)
    plan, predicted = _replay_plan(backend, trace, "arrival", rule)
    assert (predicted["forwards"], predicted["tokens_prefilled"]) == (live.forwards, live.tokens_prefilled)
    assert _costly(plan) == _costly(live.plan)
