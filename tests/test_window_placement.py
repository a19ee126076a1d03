"""ContextWindow(placement="scheduler") and ContextWindow(fidelity_target=...) on tiny models."""

from __future__ import annotations

import pytest
import torch

import contextdeque as cd
from contextdeque.core import compat
from contextdeque.core.errors import WindowError
from contextdeque.patch import energy_rank
from helpers import micro_llama, seeded_ids


@pytest.fixture(scope="module")
def micro():
    return cd.HFBackend(micro_llama(3), None, root_ids=[1, 2, 3], name="micro-llama")


def _kv_close(a, b, tol=1e-4):
    return all(torch.allclose(x, y, atol=tol) and torch.allclose(u, v, atol=tol) for (x, u), (y, v) in zip(a, b))


def test_scheduler_recall_lands_where_its_patch_is_valid(micro, one_thread):
    runs = {}
    for placement in ("arrival", "scheduler"):
        w = cd.ContextWindow(micro, rank=4, placement=placement, patch_policy="eager")
        a = w.append(token_ids=seeded_ids(12, 1, 60))
        b = w.append(token_ids=seeded_ids(10, 2, 60))
        c = w.append(token_ids=seeded_ids(14, 3, 60))
        w.evict(b)
        r = w.recall(b)
        runs[placement] = (w, r, [x for x in w.refs], (a, b, c))
    w, r, refs, (a, b, c) = runs["arrival"]
    assert refs == [a, c, b] and r.patches_formed >= 1
    w, r, refs, (a, b, c) = runs["scheduler"]
    assert refs == [a, b, c]  # back behind A, where its stored patch is exact again
    assert r.patches_formed == 0 and r.patches_reused == 1
    assert w.context.placement.decisions["exact"] >= 1


def test_scheduler_window_matches_reprefill_under_exact_policy(micro, one_thread):
    w = cd.ContextWindow(micro, placement="scheduler", patch_policy="exact")
    refs = [w.append(token_ids=seeded_ids(8 + i, 10 + i, 60)) for i in range(4)]
    w.evict(refs[1])
    w.recall(refs[1])
    ids = torch.tensor([list(micro.root_ids) + sum((w.chunk(r).token_ids.tolist() for r in w.refs), [])])
    with torch.no_grad():
        out = micro.model(input_ids=ids, use_cache=True)
    n = compat.cache_num_layers(out.past_key_values)
    ref_kv = [compat.cache_layer(out.past_key_values, i) for i in range(n)]
    cache = w.materialize()
    got = [compat.cache_layer(cache, i) for i in range(n)]
    assert _kv_close(got, ref_kv, 2e-4)


def test_unknown_placement_refused(micro):
    with pytest.raises(WindowError):
        cd.ContextWindow(micro, placement="nope")
    with pytest.raises(WindowError):
        cd.ContextWindow(micro, fidelity_target=1.5)


def test_energy_rank_rule():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(2, 40, 3, generator=g)
    w_ = torch.randn(2, 3, 24, generator=g)
    delta = u @ w_  # rank 3 per layer
    m, e = energy_rank(delta, 0.999999, 16)
    assert m == 3 and e == pytest.approx(1.0, abs=1e-9)
    m1, e1 = energy_rank(delta, 0.5, 16)
    assert 1 <= m1 <= 3 and e1 >= 0.5
    assert energy_rank(delta, 0.999999, 2)[0] == 2  # the cap wins
    assert energy_rank(torch.zeros(2, 5, 4), 0.9, 4) == (0, 1.0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fidelity_target_chooses_rank_per_chunk(tiny_backend_factory, one_thread, arch):
    be = tiny_backend_factory(arch)
    w = cd.ContextWindow(be, fidelity_target=0.9, max_patch_fraction=0.5, patch_policy="eager")
    w.append(token_ids=seeded_ids(24, 1))
    r2 = w.append(token_ids=seeded_ids(30, 2))
    (p,) = w.patches(r2)
    cap_k, cap_v = w.context.adaptive_cap(30)
    assert 1 <= p.rank_k <= cap_k and 1 <= p.rank_v <= cap_v
    # the target is reached, unless the byte cap stopped the rank first
    assert float(p.meta["energy_k"]) >= 0.9 - 1e-9 or p.rank_k == cap_k
    assert float(p.meta["energy_v"]) >= 0.9 - 1e-9 or p.rank_v == cap_v
    w99 = cd.ContextWindow(be, fidelity_target=0.999, max_patch_fraction=1.0, store=None, patch_policy="eager")
    w99.append(token_ids=seeded_ids(24, 1))
    q = w99.patches(w99.append(token_ids=seeded_ids(30, 2)))[0]
    assert q.rank_k >= p.rank_k and q.rank_v >= p.rank_v  # a higher target never takes fewer directions
