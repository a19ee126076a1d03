"""ContextWindow(answer_kl_budget=...): the fidelity floor (window.budget, issue 21 item 4). A budget
that binds forms the patch that matters most (exactly what heal() would form for it); one that does
not binds nothing; the estimate and what each chunk was served are reported."""

from __future__ import annotations

import pytest
import torch
from helpers import micro_llama

from contextdeque.core import compat
from contextdeque.core.errors import WindowError
from contextdeque.model.hf import HFBackend
from contextdeque.window import ContextWindow
from contextdeque.window.budget import DEFAULT_BLIND_KL
from contextdeque.window.placement import END

POOL = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15], [20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36], [40, 41, 42]]


@pytest.fixture(scope="module")
def backend(one_thread):
    return HFBackend(micro_llama(11), None, root_ids=[1, 3], name="tiny-budget-llama")


def build(backend, **kw):
    """Five known pages through a budget of four (the first slides out), healed after each append.
    Anticipation off unless asked: the budget acts where idle time did not prepare the step."""
    kw.setdefault("anticipate", False)
    win = ContextWindow(backend, budget_tokens=22, rank=2, **kw)
    refs = []
    for p in POOL:
        refs.append(win.append(chunk=backend.encode(token_ids=p)))
        win.heal()
    assert refs[0] not in win.refs
    return win, refs


def _cache(win):
    cache = win.materialize()
    return [compat.cache_layer(cache, l) for l in range(compat.cache_num_layers(cache))]


def test_a_budget_that_does_not_bind_forms_nothing_and_reports_the_estimate(backend):
    win, refs = build(backend, answer_kl_budget=10.0)
    r = win.recall(refs[0], at=END)  # no stored patch behind this window: served blind
    assert r.forwards == 0 and r.budget is not None and not r.budget.bound
    served = {c.ref: c for c in r.budget.chunks}
    assert served[refs[0]].served == "blind" and served[refs[0]].deficit == 1.0
    assert served[refs[0]].kl == pytest.approx(DEFAULT_BLIND_KL)
    assert r.budget.estimate == pytest.approx(sum(c.kl for c in r.budget.chunks)) and r.budget.estimate > 0
    assert r.budget.after == r.budget.estimate
    assert refs[0] in win.pending_refs  # still queued for heal
    assert r.as_dict()["budget"]["chunks"][-1]["served"] == "blind"


def test_a_budget_that_binds_forms_the_patch_heal_would(backend):
    # cascade "keep": the chunks conditioned on the recalled one keep their patches, so the recalled
    # chunk is the one deferred chunk (with "reform" the cascade's chunks are deferred too)
    bound, refs = build(backend, answer_kl_budget=1e-4, cascade_policy="keep")
    plain, refs_p = build(backend, cascade_policy="keep")
    r = bound.recall(refs[0], at=END)
    assert r.budget.bound and r.budget.formed == refs[0]
    assert r.forwards >= 1 and r.patches_formed >= 1
    assert r.budget.estimate > 1e-4 and r.budget.after < r.budget.estimate
    assert refs[0] not in bound.pending_refs and bound.last_receipt is r
    plain.recall(refs_p[0], at=END)
    plain.heal()  # the latency window healed: what the bound step formed at once
    for (k0, v0), (k1, v1) in zip(_cache(plain), _cache(bound)):
        assert torch.allclose(k0, k1, atol=1e-6) and torch.allclose(v0, v1, atol=1e-6)


def test_a_miss_forms_only_the_recalled_chunks_own_patch(backend):
    """Cascade "reform": the chunks conditioned on the recalled one are deferred too (equal
    estimates); the recalled chunk's patch is the one formed, on the window as it stands (one
    forward, not stored, still queued for heal), not the whole dependent tail."""
    win, refs = build(backend, answer_kl_budget=1e-4)
    r = win.recall(refs[0], at=END)
    pending_in_front = [c for c in r.budget.chunks if c.ref != refs[0] and c.kl > 0]
    assert pending_in_front  # the dependent tail, deferred
    assert r.budget.formed == refs[0] and r.forwards == 1 and r.patches_formed == 1
    assert r.budget.after < r.budget.estimate
    assert refs[0] in win.pending_refs  # heal() forms the eager policy's patch once the tail is healed
    healed = win.heal()
    assert healed.forwards >= len(pending_in_front) and not win.pending_refs


def test_no_budget_no_report_and_eager_windows_never_bind(backend):
    win, refs = build(backend)
    assert win.recall(refs[0], at=END).budget is None
    eager, refs_e = build(backend, patch_policy="eager", answer_kl_budget=1e-9)
    r = eager.recall(refs_e[0], at=END)
    assert not r.budget.bound and r.budget.estimate == 0.0  # the eager policy defers nothing


def test_the_time_cap_skips_a_patch_predicted_to_be_too_slow(backend):
    win, refs = build(backend, answer_kl_budget=1e-4, kl_budget_ms=0.0)
    r = win.recall(refs[0], at=END)
    if r.budget.bound:  # nothing measured before it: it ran (and measured); the next one is predicted
        assert r.budget.predicted_ms is None
        win.evict(refs[2])
        r = win.recall(refs[2], at=END)
    assert not r.budget.bound and "time cap" in r.budget.skipped and r.budget.predicted_ms > 0
    assert r.forwards == 0 and r.budget.after == r.budget.estimate


def test_budget_settings_are_checked(backend):
    for bad in ({"answer_kl_budget": -1.0}, {"kl_budget_ms": -5.0}, {"blind_kl": 0.0}):
        with pytest.raises(WindowError):
            ContextWindow(backend, **bad)


def test_valid_patches_count_the_envelopes_residual(backend, monkeypatch):
    """Under a fidelity target on a model with a calibrated envelope, a valid chunk's estimate is
    (1 - the envelope's η for its patch) x blind_kl; without a target it counts 0."""
    from contextdeque.model import envelope
    from contextdeque.model.envelope import FidelityEnvelope

    env = FidelityEnvelope(fingerprint=backend.fingerprint, model="m", energies=(0.5, 0.9, 0.99),
                           median_eta=(0.4, 0.8, 0.9), p10_eta=(0.3, 0.7, 0.8), mean_bytes_fraction=(0.1, 0.2, 0.3),
                           n_items=3, items=("a",))
    monkeypatch.setitem(envelope._ENVELOPES, backend.fingerprint, env)
    win = ContextWindow(backend, rank=2, patch_policy="eager", fidelity_target=0.8, max_patch_fraction=1.0,
                        answer_kl_budget=10.0)
    win.append(token_ids=POOL[0])
    r = win.append(token_ids=POOL[1]).receipt
    second = r.budget.chunks[1]
    assert second.served == "valid" and 0.0 < second.deficit <= 0.2 + 1e-6
    assert second.kl == pytest.approx(DEFAULT_BLIND_KL * second.deficit)
    assert r.budget.chunks[0].deficit == 0.0  # the front: its canonical, exact


def test_a_saved_window_keeps_its_floor_and_recall_placement(backend, tmp_path):
    win = ContextWindow(backend, rank=2, answer_kl_budget=2e-3, kl_budget_ms=50.0, blind_kl=0.1, recall_placement=None)
    win.append(token_ids=POOL[0])
    win.save(tmp_path / "s.cdq")
    opened = ContextWindow.open(tmp_path / "s.cdq", backend)
    cfg = opened.context.config
    assert (cfg.answer_kl_budget, cfg.kl_budget_ms, cfg.blind_kl, cfg.recall_placement) == (2e-3, 50.0, 0.1, None)
