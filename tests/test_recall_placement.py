"""recall(ref) lets the window choose a valid place (recall_placement="valid", the placement
scheduler); recall(ref, at=...) insists; receipts say where it went and why (issue 21, item 2)."""

from __future__ import annotations

import pytest
import torch
from helpers import micro_llama, seeded_ids

import contextdeque as cd
from contextdeque.core import compat
from contextdeque.core.errors import WindowError, WindowTypeError
from contextdeque.window.placement import END


@pytest.fixture(scope="module")
def micro(one_thread):
    return cd.HFBackend(micro_llama(5), None, root_ids=[1, 2, 3], name="micro-llama-recall")


def _cache(win):
    cache = win.materialize()
    return [compat.cache_layer(cache, l) for l in range(compat.cache_num_layers(cache))]


def _all_valid(win) -> bool:
    """Every chunk's conditioning was formed on exactly the chunks (and states) now in front of it."""
    slots = [win.slot(r) for r in win.refs]
    return all(s.conditioned_on == tuple((p.ref, p.version) for p in slots[:i]) for i, s in enumerate(slots))


def _window(micro, **kw):
    w = cd.ContextWindow(micro, rank=4, patch_policy="eager", **kw)
    refs = [w.append(token_ids=seeded_ids(8 + i, 20 + i, 60)) for i in range(4)]
    return w, refs


def test_lookback_goes_back_behind_its_antecedents_and_revalidates_the_tail(micro):
    w, (a, b, c, d) = _window(micro)
    before = _cache(w)
    w.evict(b)
    assert not _all_valid(w)  # c and d were conditioned on b
    r = w.recall(b)
    assert w.refs == (a, b, c, d)
    assert r.forwards == 0 and r.patches_reused == 1 and r.patches_formed == 0
    assert r.placed == ((b, 1, "behind its stored patch's antecedents"),)
    assert dict(r.served) == {b: "recurring"}  # its patch on (a): formed at its append, served again
    assert _all_valid(w)  # c and d hold what they held before b left: valid again
    for (k0, v0), (k1, v1) in zip(before, _cache(w)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_page_that_slid_out_goes_back_in_front_where_its_canonical_is_exact(micro):
    w, (a, b, c, d) = _window(micro)
    before = _cache(w)
    w.slide(1)
    r = w.recall(a)
    assert w.refs == (a, b, c, d) and r.forwards == 0
    assert r.placed == ((a, 0, "front: canonical exact"),)
    assert _all_valid(w)
    for (k0, v0), (k1, v1) in zip(before, _cache(w)):
        assert torch.allclose(k0, k1, atol=1e-6) and torch.allclose(v0, v1, atol=1e-6)


def test_at_insists_and_end_is_explicit(micro):
    w, (a, b, c, d) = _window(micro)
    w.evict(b)
    r = w.recall(b, at=END)
    assert w.refs == (a, c, d, b) and r.placed == ((b, 3, "asked"),) and r.forwards >= 1
    w.evict(b)
    r = w.recall(b, at=0)
    assert w.refs == (b, a, c, d) and r.placed == ((b, 0, "asked"),)
    w.evict(b)
    with pytest.raises(WindowError, match="index or 'end'"):
        w.recall(b, at="middle")
    assert b in w.evicted_refs  # the failed recall left the window as it was


def test_recall_placement_none_keeps_the_old_rule(micro):
    w, (a, b, c, d) = _window(micro, recall_placement=None)
    w.evict(b)
    r = w.recall(b)
    assert w.refs == (a, c, d, b) and r.placed == ((b, 3, "end"),)


def test_no_valid_place_goes_to_the_end(micro):
    """A chunk whose stored patch's antecedents are gone and that was never at the front: nothing
    valid to seek; the end (the scheduler never forms more than the end would)."""
    w, (a, b, c, d) = _window(micro)
    w.evict(c)
    w.evict(a)  # c's patch was formed on (a, b): that prefix is gone
    r = w.recall(c)
    assert r.placed[0][1] in (0, len(w.refs) - 1)
    end = cd.ContextWindow(micro, rank=4, patch_policy="eager")
    refs = [end.append(token_ids=seeded_ids(8 + i, 20 + i, 60)) for i in range(4)]
    end.evict(refs[2])
    end.evict(refs[0])
    r_end = end.recall(refs[2], at=END)
    assert r.patches_formed <= r_end.patches_formed


def test_without_the_scheduler_loaded_an_unpinned_recall_goes_to_the_end_and_says_why(micro, monkeypatch):
    import sys

    from contextdeque.window import placement

    monkeypatch.delitem(placement.PLACEMENT_POLICIES, "valid")
    monkeypatch.delitem(sys.modules, placement.SCHEDULER_MODULE)
    w, (a, b, c, d) = _window(micro)
    w.evict(b)
    r = w.recall(b)
    assert w.refs == (a, c, d, b) and "import contextdeque.scheduler" in r.placed[0][2]


def test_recall_placement_is_checked(micro):
    with pytest.raises(WindowTypeError):
        cd.ContextWindow(micro, recall_placement=3)
    w = cd.ContextWindow(micro, rank=4, recall_placement="no-such-placement")
    a = w.append(token_ids=seeded_ids(8, 1, 60))
    w.append(token_ids=seeded_ids(8, 2, 60))
    w.evict(a)
    with pytest.raises(WindowError, match="not a registered placement"):
        w.recall(a)
    assert w.recall(a, at=END).placed[0][2] == "asked"  # pinned recalls never consult it


def test_receipt_placed_in_as_dict(micro):
    w, (a, b, c, d) = _window(micro)
    w.evict(b)
    assert w.recall(b).as_dict()["placed"] == [[b.key, 1, "behind its stored patch's antecedents"]]


def test_valid_placement_is_registered():
    from contextdeque.scheduler import ValidPlacement
    from contextdeque.window.placement import make_placement

    p = make_placement("valid")
    assert isinstance(p, ValidPlacement) and p.weights.diverge == 0.0


def test_served_says_orbit_for_a_stored_orbit_patch(micro):
    w, (a, b, c, d) = _window(micro)
    first = w.reorder([b, a, c, d])  # c: the same antecedent set in another order: an orbit patch
    assert dict(first.served)[c] == "fresh" and dict(first.served)[a] == "fresh"
    w.reorder([a, b, c, d])
    again = w.reorder([b, a, c, d])
    assert again.forwards == 0
    assert dict(again.served)[c] == "orbit"  # the stored orbit patch of {a, b}
    assert dict(again.served)[a] == "recurring"  # its exact patch on (b), formed by the first reorder
