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


# A fresh process that imports the window alone (not ``contextdeque``, which imports nothing
# either, nor the scheduler): an unpinned look-back recall and a recall of the page that slid out.
_ONLY_THE_WINDOW = """
import json, sys
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "scheduler":
    import contextdeque.scheduler
import torch
from contextdeque.model.hf import HFBackend
from contextdeque.window import ContextWindow
from helpers import micro_llama, seeded_ids

torch.set_num_threads(1)
backend = HFBackend(micro_llama(5), None, root_ids=[1, 2, 3], name="micro-llama-recall")
out = []
for step in ("lookback", "slide"):
    w = ContextWindow(backend, rank=4, patch_policy="eager")
    refs = [w.append(token_ids=seeded_ids(8 + i, 20 + i, 60)) for i in range(4)]
    if step == "lookback":
        w.evict(refs[1])
    else:
        w.slide(1)
    loaded = "contextdeque.scheduler" in sys.modules
    r = w.recall(refs[1] if step == "lookback" else refs[0])
    out.append({"step": step, "scheduler_loaded_before": loaded, "order": [refs.index(x) for x in w.refs],
                "index": r.placed[0][1], "why": r.placed[0][2], "forwards": r.forwards,
                "formed": r.patches_formed, "scheduler_loaded_after": "contextdeque.scheduler" in sys.modules})
print(json.dumps(out))
"""


def _recalls_in_a_fresh_process(mode: str) -> list[dict]:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", _ONLY_THE_WINDOW, str(Path(__file__).parent), mode],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_unpinned_recall_is_placed_alike_whatever_the_process_imported():
    """The default ``recall_placement="valid"`` lives in the scheduler, a layer the window never
    imports: looking it up imports its home (``PLACEMENT_POLICIES.homes``), so a process that
    imported only the window places an unpinned recall where one that imported the scheduler does."""
    alone, with_scheduler = _recalls_in_a_fresh_process("window"), _recalls_in_a_fresh_process("scheduler")
    assert not alone[0]["scheduler_loaded_before"]  # the window alone, up to the first recall,
    assert alone[0]["scheduler_loaded_after"]  # which found the rule through the registry
    assert all(r["scheduler_loaded_before"] for r in with_scheduler)
    strip = lambda runs: [{k: v for k, v in r.items() if not k.startswith("scheduler_loaded")} for r in runs]  # noqa: E731
    assert strip(alone) == strip(with_scheduler)
    assert [(r["order"], r["index"], r["why"], r["forwards"]) for r in alone] == [
        ([0, 1, 2, 3], 1, "behind its stored patch's antecedents", 0),
        ([0, 1, 2, 3], 0, "front: canonical exact", 0),
    ]


def test_placement_homes_register_what_they_name():
    """Every name ``PLACEMENT_POLICIES`` declares a home for is registered by that home (a stale
    home would leave the name unfound), and a class may not register a homed name elsewhere."""
    from contextdeque.window.placement import PLACEMENT_POLICIES, PlacementPolicy

    assert set(PLACEMENT_POLICIES.homes) == {"scheduler", "scheduler-offline", "valid"}
    for name, home in PLACEMENT_POLICIES.homes.items():
        assert name in PLACEMENT_POLICIES and PLACEMENT_POLICIES[name].__module__.startswith(home + ".")
    assert {"arrival", *PLACEMENT_POLICIES.homes} <= set(PLACEMENT_POLICIES)
    with pytest.raises(ValueError, match="declared to live in contextdeque.scheduler"):
        type("Impostor", (PlacementPolicy,), {"name": "valid", "__module__": __name__})


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
