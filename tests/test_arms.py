"""Reuse arms: registry, exact reproduction of re-prefill at a 100% budget, in-context recompute
semantics (partial selection, per-layer ghost rows, sliding windows), cost reports."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import seeded_ids

from contextdeque.eval.arms import (
    ARMS,
    BlindArm,
    CacheBlendArm,
    EpicArm,
    PatchArm,
    PrefixCacheArm,
    ProfileSample,
    ReprefillArm,
    ReuseRequest,
    VLCacheArm,
    kv_row_bytes,
    linear_schedule,
    make_arm,
    matched_token_budget,
    profile_schedule,
)
from contextdeque.eval.arms.vlcache import allocate_schedule, check_schedule
from contextdeque.core.errors import FingerprintMismatchError, ReuseArmError
from contextdeque.patch import form_patch
from contextdeque.patch.ops import truncate_patch


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def be(tiny_backend_factory):
    # three layers so per-layer schedules have a middle
    return tiny_backend_factory("llama", seed=0, num_hidden_layers=3)


@pytest.fixture(scope="module")
def chunks(be):
    g = torch.Generator().manual_seed(7)
    image = torch.randn(12, 128, generator=g) * 0.05  # an embedding span (image-like chunk)
    return [
        be.encode(token_ids=seeded_ids(20, 1)),
        be.encode(embeds=image),
        be.encode(token_ids=seeded_ids(25, 3)),
    ]


@pytest.fixture(scope="module")
def text_chunks(be):
    return [be.encode(token_ids=seeded_ids(18, 4)), be.encode(token_ids=seeded_ids(22, 5)), be.encode(token_ids=seeded_ids(15, 6))]


def _err(a, b) -> float:
    return max(max(float((x - y).abs().max()) for x, y in zip(p, q)) for p, q in zip(a, b))


def test_registry_has_every_arm():
    assert {"reprefill", "prefix_cache", "blind", "patch", "cacheblend", "epic", "vlcache"} <= set(ARMS)
    assert isinstance(make_arm("cacheblend", ratio=0.2), CacheBlendArm)
    with pytest.raises(ReuseArmError):
        make_arm("nope")


def _full_budget_arms(req):
    seeded = PrefixCacheArm()
    seeded.seed_canonicals(req.backend, req.chunks)
    return {
        "reprefill": ReprefillArm(),
        "prefix_cache-cold": PrefixCacheArm(),
        "prefix_cache-seeded": seeded,
        "patch-full": PatchArm("full"),
        "cacheblend-100": CacheBlendArm(1.0),
        "cacheblend-budget": CacheBlendArm(budget=10_000),
        "epic-all": EpicArm(10_000),
        "vlcache-100": VLCacheArm(1.0),
        "vlcache-ones": VLCacheArm(schedule=[1.0, 1.0, 1.0]),
    }


@pytest.mark.parametrize("which", ["mixed", "text"])
def test_every_arm_reproduces_reprefill_at_full_budget(be, chunks, text_chunks, which):
    cs = chunks if which == "mixed" else text_chunks
    req = ReuseRequest(be, cs)
    ref = ReprefillArm().run(req)
    scale = max(float(k.abs().max()) for k, _ in ref.kv)
    for name, arm in _full_budget_arms(req).items():
        out = arm.run(req)
        assert out.next_position == req.next_position
        assert out.kv[0][0].shape == ref.kv[0][0].shape, name
        assert _err(out.kv, ref.kv) <= 1e-5 * scale, name
    assert _err(BlindArm().run(req).kv, ref.kv) > 1e-2 * scale  # blind reuse is not exact


def test_blind_is_exact_for_a_single_chunk(be, text_chunks):
    req = ReuseRequest(be, text_chunks[:1])
    assert _err(BlindArm().run(req).kv, ReprefillArm().run(req).kv) < 1e-4


def test_recomputing_one_whole_chunk_in_context(be, text_chunks):
    """Chunk 0 is exact blind (no antecedent); recomputing all of chunk 1 in context — whoever
    picks it — must give re-prefill."""
    cs = text_chunks[:2]
    req = ReuseRequest(be, cs)
    ref = ReprefillArm().run(req)
    T1 = cs[1].n_tokens
    epic = EpicArm([0, T1]).run(req)
    assert epic.report.tokens_recomputed == T1
    assert _err(epic.kv, ref.kv) < 1e-4
    # CacheBlend ranks by deviation at layer 1: chunk 0's tokens deviate by float noise only
    cb = CacheBlendArm(budget=T1, check_layer=1).run(req)
    assert _err(cb.kv, ref.kv) < 1e-4
    assert cb.report.forwards == 2  # the check pass and the recompute


def test_vlcache_ghost_rows(be, text_chunks):
    """Schedule [1, 1, 0]: every token is recomputed in context at layers 0 and 1 and keeps its
    reused KV at layer 2 (and attention at layer 2 sees the reused rows)."""
    req = ReuseRequest(be, text_chunks)
    ref = ReprefillArm().run(req)
    blind = BlindArm().run(req)
    out = VLCacheArm(schedule=[1.0, 1.0, 0.0]).run(req)
    R = req.root_len
    for l in (0, 1):
        for a, b in zip(out.kv[l], ref.kv[l]):
            assert float((a - b).abs().max()) < 1e-4
    for a, b in zip(out.kv[2], blind.kv[2]):
        assert torch.equal(a[:, R:], b[:, R:])
    assert out.report.token_layers == 2 * req.n_chunk_tokens
    # and the ghost rows matter: a forward that recomputed layer 2 too differs there
    assert _err([ref.kv[2]], [out.kv[2]]) > 1e-3


def test_vlcache_schedules(be, text_chunks):
    s = linear_schedule(30, 0.15)
    assert len(s) == 30 and abs(sum(s) / 30 - 0.15) < 1e-12
    assert all(b <= a for a, b in zip(s, s[1:]))
    assert linear_schedule(5, 1.0) == [1.0] * 5
    with pytest.raises(ReuseArmError):
        check_schedule([0.1, 0.2])
    with pytest.raises(ReuseArmError):
        VLCacheArm(schedule=[0.5, 1.5])
    with pytest.raises(ReuseArmError):
        VLCacheArm(schedule=[0.5, 0.2]).run(ReuseRequest(be, text_chunks))  # 2 ratios, 3 layers
    out = VLCacheArm(schedule=[0.5, 0.25, 0.0]).run(ReuseRequest(be, text_chunks))
    per_layer = [math.ceil(r * c.n_tokens - 1e-9) for r in (0.5, 0.25, 0.0) for c in text_chunks]
    assert out.report.token_layers == sum(per_layer)


def test_allocate_schedule_is_greedy_monotone_and_in_budget():
    rates = [0.1, 0.5]
    # layer 2 is by far the most sensitive: reaching it needs raising layers 0 and 1 too
    S = torch.tensor([[0.9, 0.8], [0.9, 0.8], [0.2, 0.0]], dtype=torch.float64)
    sched = allocate_schedule(S, rates, target_ratio=0.1, base_error=1.0)
    assert sched == [0.1, 0.1, 0.1]
    sched = allocate_schedule(S, rates, target_ratio=0.5, base_error=1.0)
    assert all(b <= a for a, b in zip(sched, sched[1:])) and sum(sched) / 3 <= 0.5 + 1e-12
    assert sched == [0.5, 0.5, 0.5]


def test_profile_schedule_on_a_tiny_model(be, text_chunks):
    req = ReuseRequest(be, text_chunks)
    ref = ReprefillArm().run(req)
    q = seeded_ids(5, 11).tolist()
    lg = be.forward(input_ids=q, positions=be.text_positions(req.next_position, 5), past=ref.kv).logits[-1]
    sched = profile_schedule([ProfileSample(req, q, lg)], target_ratio=0.2, rates=(0.1, 0.3))
    check_schedule(sched, 3)
    assert sum(sched) / 3 <= 0.2 + 1e-9


def test_costs_are_reported(be, text_chunks):
    req = ReuseRequest(be, text_chunks)
    assert ReprefillArm().run(req).report.forwards == 1
    b = BlindArm().run(req).report
    assert (b.forwards, b.tokens_recomputed, b.bytes_extra) == (0, 0, 0)
    assert b.bytes_stored == sum(c.nbytes for c in text_chunks)
    p = PatchArm(4).run(req)
    assert p.report.compile_forwards == len(text_chunks) - 1 and p.report.forwards == 0
    ranks = p.report.extras["patch_ranks"]
    assert ranks[0] == [] and all(r == [(4, 4)] for r in ranks[1:])
    e = EpicArm(8).run(req).report
    assert e.tokens_recomputed == sum(min(8, c.n_tokens) for c in text_chunks)
    assert abs(e.recompute_fraction - e.tokens_recomputed / req.n_chunk_tokens) < 1e-12
    c = CacheBlendArm(0.15).run(req).report
    assert c.tokens_recomputed == round(0.15 * req.n_chunk_tokens) and c.forwards == 2


def test_patch_arm_uses_and_truncates_given_patches(be, text_chunks):
    full = {i: form_patch(be, text_chunks[i], text_chunks[:i], rank="full") for i in (1, 2)}
    req = ReuseRequest(be, text_chunks, patches=full)
    before = be.forwards_run
    out = PatchArm(3).run(req)
    assert be.forwards_run == before  # nothing formed at serve time
    assert out.report.bytes_extra == sum(truncate_patch(p, 3).nbytes for p in full.values())


def test_matched_token_budget(be, text_chunks):
    p = form_patch(be, text_chunks[1], text_chunks[:1], rank=4)
    row = kv_row_bytes(text_chunks[1])
    assert row == text_chunks[1].nbytes / text_chunks[1].n_tokens
    assert matched_token_budget(p, text_chunks[1]) == min(text_chunks[1].n_tokens, int(p.nbytes // row))


def test_prefix_cache_reuses_only_a_leading_prefix(be, text_chunks):
    a, b, c = text_chunks
    pc = PrefixCacheArm(max_entries=4)
    first = pc.run(ReuseRequest(be, [a, b]))
    assert first.report.extras["prefix_chunks_hit"] == 0
    req = ReuseRequest(be, [a, b, c])
    out = pc.run(req)
    assert out.report.extras["prefix_chunks_hit"] == 2
    assert out.report.tokens_prefilled == c.n_tokens
    assert _err(out.kv, ReprefillArm().run(req).kv) < 1e-4
    assert pc.run(ReuseRequest(be, [b, a])).report.extras["prefix_chunks_hit"] == 0  # order matters
    tiny_cache = PrefixCacheArm(max_entries=1)
    tiny_cache.run(ReuseRequest(be, [a]))
    tiny_cache.run(ReuseRequest(be, [b]))
    assert len(tiny_cache) == 1 and tiny_cache.lookup(be, [a])[0] == 0  # least recently used dropped


def test_requests_refuse_bad_input(be, tiny_backend_factory):
    with pytest.raises(ReuseArmError):
        ReuseRequest(be, [])
    other = tiny_backend_factory("llama", seed=3, num_hidden_layers=3)
    with pytest.raises(FingerprintMismatchError):
        ReuseRequest(be, [other.encode(token_ids=seeded_ids(8, 1))])
    with pytest.raises(ReuseArmError):
        CacheBlendArm(1.5)
    with pytest.raises(ReuseArmError):
        EpicArm([1, 2]).run(ReuseRequest(be, [be.encode(token_ids=seeded_ids(8, 2))]))


def test_sliding_window_model_recomputes_exactly(tiny_backend_factory):
    """Gemma3 has sliding-window layers: the recompute mask must keep their window."""
    gb = tiny_backend_factory("gemma3_text", seed=0, sliding_window=8)
    cs = [gb.encode(token_ids=seeded_ids(14, 1)), gb.encode(token_ids=seeded_ids(12, 2))]
    req = ReuseRequest(gb, cs)
    ref = ReprefillArm().run(req)
    assert _err(CacheBlendArm(1.0).run(req).kv, ref.kv) < 1e-4
    assert _err(EpicArm([0, 12]).run(req).kv, ref.kv) < 1e-4
