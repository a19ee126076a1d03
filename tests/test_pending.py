"""``window.pending.PendingWork``: the one record of what the heal owes each chunk key, kept by the
live window (over refs: ``WindowState.pending``) and by the replay (over chunk ids:
``Replayer.pending``). Its transitions are checked here on keys; that both executors then agree
is ``test_replay_matches_window.py``'s."""

from __future__ import annotations

from contextdeque.window.pending import Pending, PendingWork, heal_need
from contextdeque.window.state import WindowState


def test_a_deferral_keeps_its_first_reason_and_a_cascade_stays_asked():
    p: PendingWork[str] = PendingWork()
    p.defer("a", "reorder")
    p.defer("a", "recall")  # (deferred again: the first reason is what the heal decides on)
    assert p["a"] == Pending("reorder") and list(p) == ["a"] and len(p) == 1
    p.defer("b", cascade=True)
    p.defer("b", "inserted")  # a reason arrives after the cascade asked: both kept
    assert p["b"] == Pending("inserted", cascade=True)
    p.defer("b")  # (a plain deferral does not take the cascade back)
    assert p["b"].cascade
    p.requeue("b")  # a refresh hit on a chunk with no canonical: re-conditioned, no forced re-form
    assert p["b"] == Pending("inserted") and p.reconditions("b")
    assert p.pop("b") == Pending("inserted") and p.pop("b") is None and "b" not in p


def test_new_content_is_entering_then_forwarded_then_canonical_at_the_heal():
    p: PendingWork[str] = PendingWork()
    p.enter("a")
    p.enter("b")
    assert p.provisional("a") and not p.unencoded("a") and not p.queued_work()
    p.forward("a", ("ha",))  # its forward ran behind the content prefix ("ha",)
    assert p.unencoded("a") and p.forwarded == {"a": ("ha",)} and p.queued_work()
    assert p.take_entering() == ["b"] and not p.entering  # b never forwarded: encoded now
    assert p.heal_keys(["x", "a"]) == {"a"} and p.heal_keys(["x"]) == set()
    # under lazy canonicals, a forwarded chunk appended once keeps its forward where it stands
    assert p.heal_need("a", 2, lazy=True) == "keep" and p.heal_need("a", 2, lazy=False) == "canonical"
    assert p.take_forwarded("a") == ("ha",) and not p.forwarded
    p.keep_uncanonical("a")
    assert p.unencoded("a") and not p.queued_work()
    p.owe_canonical("a")  # it reached the front
    assert p.reconditions("a") and p.heal_need("a", 0, lazy=True) == "canonical" and p.queued_work()
    p.canonicalized("a")
    assert not p.provisional("a") and not p.queued_work() and not p.heal_work()


def test_a_chunk_leaving_unhealed_owes_its_canonical():
    p: PendingWork[str] = PendingWork()
    p.enter("new")  # entered, never forwarded: nothing computed, nothing of it stays
    assert p.leave("new", pinned=False, lazy=True) and p.owes == {"new"} and not p.departed
    for lazy, departs in ((True, False), (False, True)):
        p = PendingWork()
        p.enter("a")
        p.forward("a", ())
        p.defer("a", "reorder")
        p.owe_canonical("a")
        # its queued work goes; its canonical is owed: a recall encodes it (nothing of it stays), or
        # under latency-shared the heal does
        assert p.leave("a", pinned=False, lazy=lazy) == (not departs)
        assert not p.queued and not p.canonical_due and not p.forwarded and p.owes == {"a"}
        assert (p.departed == {"a": None}) == departs and p.heal_work() == departs
        assert p.take_departed("a") == departs and not p.take_departed("a")
        p.clear_owed("a")
        assert not p.owes
    p = PendingWork()
    p.keep_uncanonical("b")
    assert not p.leave("b", pinned=True, lazy=False) and not p.owes and not p.departed  # another window holds it
    p.defer("d", "append")
    assert not p.leave("d", pinned=False, lazy=True) and not p.owes and not p.queued  # (it had its canonical)


def test_a_discarded_fork_gives_the_parent_back_its_work():
    parent: PendingWork[str] = PendingWork()
    parent.defer("q", "reorder")
    parent.keep_uncanonical("u")  # in the fork's window too: the fork computes its canonical
    parent.keep_uncanonical("v")  # left before the fork: nothing the fork did touches it
    parent.owe_canonical("u")
    parent.enter("f")
    parent.forward("f", ("hp",))
    parent.owes.add("e")
    fork = parent.copy()
    assert fork == parent and fork is not parent and fork.queued is not parent.queued
    fork.pop("q")
    fork.canonicalized("u")
    fork.enter("g")
    fork.forward("g", ("hf",))
    fork.clear_owed("e")
    assert fork != parent
    fork.discard_fork(parent, ["q", "u", "f", "g"])
    assert fork.queued == {"q": Pending("reorder")} and fork.owes == {"e"}
    assert fork.uncanonical == {"v": None} and not fork.canonical_due  # u's canonical stays computed
    assert fork.forwarded == {"f": ("hp",), "g": ("hf",)}  # g's canonical is never made: the heal knows
    before = fork.copy()
    fork.defer("z", "inserted")
    fork.owe_canonical("v")
    fork.restore_queue(before)  # (an operation that changed no slot queues nothing)
    assert fork == before
    fork.owe_canonical("v")
    # back in the parent's window (q, f): what the fork forwarded is queued outside it, owed
    # front canonicals outside it are forgotten
    assert fork.forget_outside(["q", "f"]) == {"g"} and not fork.canonical_due


def test_the_window_settles_its_queue_after_an_operation():
    """``WindowState.settle_pending`` (``PendingWork.settle``): slots that left or were
    re-conditioned go, deferred ones are queued at the generation, one deferred again is requeued
    (keeping its first reason and what it carried)."""
    state = WindowState(generation=3)
    here = ["a", "b", "c"]
    state.pending.settle(here, 3, {"a": "append", "b": "reorder", "gone": "append"}, set(), {"b": (("x", 1),)})
    assert dict(state.pending) == {"a": Pending("append", 3), "b": Pending("reorder", 3, (("x", 1),))}
    assert not state.pending["a"].reconditions and state.pending["b"].reconditions
    state.pending.settle(here, 4, {"a": "recall"}, {"b"})
    assert dict(state.pending) == {"a": Pending("append", 3, requeued=True)} and state.pending["a"].reconditions
    copy = state.copy()
    copy.pending.settle([], 5, {}, set())
    assert not copy.pending and state.pending  # (an operation works on a copy)
    assert heal_need(1, True, True, state.pending["a"].reconditions) == "reforward"
