"""The fidelity envelope on tiny random models: the study's variants (fixed ranks, the allocation
at energies, a window's target under a byte cap), and the per-model calibration — deterministic,
cached beside the layout proofs, invalidated by a weight change (the fingerprint). Random weights
only exercise the mechanics; the figures in docs/fidelity.md come from the default model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from contextdeque.core.errors import EnvelopeError
from contextdeque.eval.fidelity.envelope import (
    calibrate_envelope,
    energy_variant,
    ensure_envelope,
    fixed_variant,
    run_variants,
    target_variant,
)
from contextdeque.eval.fidelity.probes import probe_set
from contextdeque.model.envelope import FidelityEnvelope, envelope_path, forget_envelope, load_envelope

SMALL = dict(max_chunk_tokens=48, image_grid=(3, 3))


def test_variants_run_and_order_by_bytes(tiny_backend_factory, one_thread):
    be = tiny_backend_factory("qwen2")
    variants = [fixed_variant(2), fixed_variant(8), energy_variant(0.5), energy_variant(0.99),
                target_variant(0.99, None, 0.02)]
    s = run_variants(be, probe_set(3), variants, **SMALL)
    rows = {r["variant"]: r for r in s["variants"]}
    assert rows["fixed-r8"]["patch_bytes"] > rows["fixed-r2"]["patch_bytes"]
    assert rows["energy-0.99"]["patch_bytes"] > rows["energy-0.5"]["patch_bytes"]
    assert rows["energy-0.99"]["median_energy"] >= 0.99 - 1e-6 and rows["energy-0.5"]["median_energy"] >= 0.5 - 1e-6
    capped = rows["target-0.99"]
    assert capped["bytes_fraction"] <= 0.02 + 1e-9  # the cap binds: every patch within it ...
    assert capped["misses"] == capped["patches"] > 0  # ... and every one reported as a miss
    assert s["items"] == 3 and rows["fixed-r2"]["p10_eta"] is not None


def test_items_past_the_trained_context_are_left_out(tiny_backend_factory, one_thread):
    be = tiny_backend_factory("qwen2")
    limit = be.layout.max_trained_position
    s = run_variants(be, probe_set(2), [fixed_variant(2)], max_chunk_tokens=limit, image_grid=(3, 3))
    assert len(s["items_past_trained_context"]) >= 1
    assert s["items"] + len(s["items_past_trained_context"]) <= 2


def test_envelope_map_is_monotone_and_inverts():
    env = FidelityEnvelope(fingerprint="f" * 40, model="m", energies=(0.5, 0.9, 0.99), median_eta=(0.6, 0.95, 0.93),
                           p10_eta=(0.3, 0.8, 0.9), mean_bytes_fraction=(0.1, 0.2, 0.3), n_items=3, items=("a",))
    # 0.95 at 0.9 sits above 0.93 at 0.99: the conservative curve caps it at 0.93
    assert env.eta_for(0.9) == pytest.approx(0.93) and env.eta_for(0.0) == 0.0 and env.eta_for(1.0) == 1.0
    for t in (0.3, 0.6, 0.93, 0.97, 0.999):
        e = env.energy_for(t)
        assert env.eta_for(e) >= t - 1e-9
        assert e == 1.0 or env.eta_for(e - 1e-6) < t + 1e-9
    with pytest.raises(EnvelopeError):
        dataclasses.replace(env, energies=(0.9, 0.5, 0.99))
    # with every item's η kept, the map reads their lower quartile (conservative on harder items)
    rows = ((0.2, 0.6, 0.7, 0.9, 1.0), (0.8, 0.9, 0.95, 0.97, 0.99), (0.95, 0.96, 0.98, 0.99, 1.0))
    q = dataclasses.replace(env, item_eta=rows)
    assert q.map_eta() == pytest.approx([0.6, 0.9, 0.96]) and q.eta_for(0.9) == pytest.approx(0.9)
    assert q.energy_for(0.9) <= 0.9 + 1e-12 and q.eta_for(q.energy_for(0.95)) >= 0.95 - 1e-9
    assert dataclasses.replace(q, quantile=0.5).map_eta() == pytest.approx([0.7, 0.95, 0.98])
    with pytest.raises(EnvelopeError):
        dataclasses.replace(env, item_eta=rows[:2])


def test_calibration_is_deterministic_cached_and_invalidated_by_a_weight_change(monkeypatch, tmp_path, one_thread):
    from contextdeque.model.hf import HFBackend
    from contextdeque.model.testing import TINY_ROOT_IDS, build_tiny_model

    monkeypatch.setenv("CONTEXTDEQUE_CACHE", str(tmp_path))
    model = build_tiny_model("llama", seed=3)
    be = HFBackend(model, None, root_ids=list(TINY_ROOT_IDS), name="tiny-llama")
    kw = dict(items=probe_set(3), energies=(0.5, 0.9, 0.99), sensitivity=True, **SMALL)
    first = calibrate_envelope(be, **kw)
    again = calibrate_envelope(be, **kw)
    assert first == again  # wall times are not compared
    assert len(first.sensitivity_k) == be.layout.num_layers and first.item_eta and len(first.item_eta) == 3
    plain = calibrate_envelope(be, **{**kw, "sensitivity": False})
    assert plain.sensitivity_k == () and plain.layer_sensitivity() is None and plain.median_eta != ()
    forget_envelope(be.fingerprint)
    assert load_envelope(be.fingerprint) is None
    made = ensure_envelope(be, **kw)
    assert envelope_path(be.fingerprint).is_file() and envelope_path(be.fingerprint).parent.name == "proofs"
    forget_envelope(be.fingerprint)
    before = be.forwards_run
    cached = ensure_envelope(be, **kw)
    assert cached.cached and be.forwards_run == before  # read back, nothing measured
    assert dataclasses.replace(cached, cached=False) == made
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)  # another model now
    edited = HFBackend(model, None, root_ids=list(TINY_ROOT_IDS), name="tiny-llama")
    assert edited.fingerprint != be.fingerprint
    assert load_envelope(edited.fingerprint) is None
    assert load_envelope(be.fingerprint) is not None


def test_sensitivity_probe_is_the_scorers_forward_with_exact_gradients(tiny_backend_factory, one_thread):
    """The calibration's sensitivity probe: ``query_logits`` is the harness scorer's first step
    (the same logits), its gradient through the KV agrees with central finite differences of the
    KL, and one item's sensitivities are deterministic for a seed, NaN where a layer has no
    deficit (layer 0: its KV sees no context), and aggregate to mean 1 over the measured."""
    import math

    from contextdeque.core.metrics import kl_divergence_tensor
    from contextdeque.eval.fidelity.envelope import aggregate_sensitivity, item_bases, item_sensitivity, query_logits
    from contextdeque.eval.fidelity.harness import score_query

    be = tiny_backend_factory("qwen2")
    base = next(b for b in item_bases(be, probe_set(3), **SMALL) if b.kl_blind > 1e-4)
    kv = base.kv_with(base.full)
    with torch.no_grad():
        torch.testing.assert_close(query_logits(be, kv, base.start, base.query_ids),
                                   score_query(be, kv, base.start, base.query_ids, 0)[0], rtol=1e-5, atol=1e-5)
    blind = next(iter(base.request.chunks[1:]))  # a direction to move along: the chunk's own K scaled
    layer = be.layout.num_layers - 1
    direction = torch.zeros_like(kv[layer][0])
    direction[:, -blind.n_tokens:] = kv[layer][0][:, -blind.n_tokens:]

    def kl_at(e):
        moved = list(kv)
        moved[layer] = (kv[layer][0] + e * direction, kv[layer][1])
        return kl_divergence_tensor(base.ref_logits, query_logits(be, moved, base.start, base.query_ids))

    e0 = torch.tensor(0.05, requires_grad=True)
    with torch.enable_grad():
        (g,) = torch.autograd.grad(kl_at(e0), e0)
    h = 1e-3
    with torch.no_grad():
        fd = (float(kl_at(torch.tensor(0.05 + h))) - float(kl_at(torch.tensor(0.05 - h)))) / (2 * h)
    assert float(g) == pytest.approx(fd, rel=0.05, abs=1e-7)
    n = be.layout.num_layers
    a = item_sensitivity(be, base, n, samples=2, seed=5)
    b = item_sensitivity(be, base, n, samples=2, seed=5)
    assert a is not None and len(a[0]) == len(a[1]) == n
    assert [str(x) for x in a[0] + a[1]] == [str(x) for x in b[0] + b[1]]
    assert math.isnan(a[0][0]) and math.isnan(a[1][0])
    agg = aggregate_sensitivity([a, b])
    measured = [x for x, y in zip(agg.k + agg.v, a[0] + a[1]) if not math.isnan(y)]
    assert agg.k[0] == agg.v[0] == 0.0 and all(x > 0 for x in measured)
