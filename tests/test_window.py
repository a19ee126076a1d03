"""ContextWindow: operations, receipts, transformers interop, conditioning graph, forks, errors.

Most tests run on a really tiny random llama (2 layers, hidden 32) so they take milliseconds;
one test drives the real default model (SmolLM2-135M) through a slide and a recall.
"""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from helpers import A, B, C, D, E, QUERY, micro_llama

from contextdeque.core import compat
from contextdeque.model.hf import HFBackend
from contextdeque.core.errors import BudgetError, FingerprintMismatchError, UnknownRefError, WindowError
from contextdeque.core.operator import to_content_frame
from contextdeque.stores import DiskTier, HostTier, MemoryTier, TieredStore
from contextdeque.window import decode
from contextdeque.window import (
    ChunkRef,
    ContextWindow,
    ConditioningGraph,
    Receipt,
    WindowStore,
)


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    return HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-window-llama")


@pytest.fixture(scope="module")
def other_backend() -> HFBackend:
    return HFBackend(micro_llama(1), None, root_ids=[1, 3], name="tiny-window-llama-2")


def window_ids(win: ContextWindow) -> list[int]:
    ids = list(win.root_ids)
    for r in win.refs:
        ids += win.chunk(r).token_ids.tolist()
    return ids


def reprefill(backend: HFBackend, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return backend.forward(input_ids=ids, positions=backend.text_positions(0, len(ids)), logits="none").kv


def cache_err(cache, ref_kv) -> float:
    err = 0.0
    for l, (k, v) in enumerate(ref_kv):
        ck, cv = compat.cache_layer(cache, l)
        assert ck.shape[2] == k.shape[1]
        err = max(err, float((ck[0] - k).abs().max()), float((cv[0] - v).abs().max()))
    return err


def snapshot(win: ContextWindow):
    """Everything observable about a window's state."""
    cache = win.materialize()
    kv = [tuple(t.clone() for t in compat.cache_layer(cache, l)) for l in range(compat.cache_num_layers(cache))]
    return (win.refs, win.evicted_refs, win.placement(), win.generation, win.stale_refs), kv


def assert_same_snapshot(a, b) -> None:
    assert a[0] == b[0]
    for (k1, v1), (k2, v2) in zip(a[1], b[1]):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


# ----------------------------------------------------------------------------- identity


def test_chunk_id_for_matches_encode(backend):
    assert backend.chunk_id_for(token_ids=A) == backend.encode(token_ids=A).id
    emb = backend.embed_tokens(torch.tensor(B))
    assert backend.chunk_id_for(embeds=emb) == backend.encode(embeds=emb).id
    assert backend.chunk_id_for(token_ids=A, storage="bfloat16") == backend.encode(token_ids=A, storage="bfloat16").id


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("cascade", ["reform", "keep", "flag"])
def test_exact_policy_equals_reprefill_through_every_operation(backend, cascade):
    win = ContextWindow(backend, budget_tokens=30, patch_policy="exact", cascade_policy=cascade)
    a, b, c, d = (win.append(token_ids=x) for x in (A, B, C, D))
    checks = []

    def check():
        checks.append(cache_err(win.materialize(), reprefill(backend, window_ids(win))))

    check()
    win.slide()
    check()
    win.reorder([d, c, b])
    check()
    win.evict(c)
    check()
    win.recall(a, at=1)
    check()
    win.recall(c, at=0)
    check()
    win.append(token_ids=E)  # overflows: the oldest slide out
    check()
    assert max(checks) < 2e-5, checks
    assert win.tokens_used <= 30


def test_materialize_feeds_transformers_generate(backend):
    """``model.generate(input_ids=win.input_ids_for(q), past_key_values=win.materialize())``
    gives exactly the tokens of a plain generate over the same ids (exact policy)."""
    win = ContextWindow(backend, patch_policy="exact")
    for x in (A, B, C):
        win.append(token_ids=x)
    ids = win.input_ids_for(QUERY)
    assert ids.shape == (1, backend.root_len + len(A) + len(B) + len(C) + len(QUERY))
    before = snapshot(win)
    cache = win.materialize()
    out = backend.model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=8, do_sample=False,
                                 attention_mask=torch.ones_like(ids), pad_token_id=0)
    plain = backend.model.generate(input_ids=ids, max_new_tokens=8, do_sample=False,
                                   attention_mask=torch.ones_like(ids), pad_token_id=0)
    assert torch.equal(out, plain)
    # generate appended to its cache; the window is untouched, the next cache is fresh
    assert compat.cache_layer(cache, 0)[0].shape[2] > ids.shape[1] - len(QUERY)
    assert_same_snapshot(before, snapshot(win))
    answer = win.generate(QUERY, max_new_tokens=8)
    assert answer.token_ids == out[0, ids.shape[1]:].tolist()
    assert answer.receipt.op == "generate" and answer.receipt.forwards >= 1


@pytest.mark.parametrize("policy", ["exact", "latency", "default"])
def test_kv_layer_reader_reads_kv_layers_one_layer_at_a_time(backend, policy):
    """``kv_layer_reader()(l)`` is ``kv_layers()[l]`` bit for bit (pages computed per layer, or
    taken from a page already computed), and it keeps reading the window as it was when later
    operations change it."""
    win = ContextWindow(backend, patch_policy=policy, rank=2)
    a, b, c = (win.append(token_ids=x) for x in (A, B, C))
    win.reorder([c, a, b])  # re-placed slots: their pages are not computed yet
    read = win.kv_layer_reader()
    whole = win.kv_layers()
    assert len(whole) == backend.layout.num_layers >= 2
    for layer in reversed(range(len(whole))):
        k, v = read(layer)
        assert torch.equal(k, whole[layer][0]) and torch.equal(v, whole[layer][1]), layer
    win.evict(a)
    assert win.kv_layers()[0][0].shape[1] < whole[0][0].shape[1]
    assert torch.equal(read(0)[0], whole[0][0])  # the snapshot, not the window now


def test_window_decoder_agrees_with_generate(backend):
    win = ContextWindow(backend, patch_policy="default", rank=2)
    for x in (A, B, C):
        win.append(token_ids=x)
    hf = win.generate(QUERY, max_new_tokens=6)
    ctx, slots = win.context, [win.slot(r) for r in win.refs]
    layers = decode.assemble(ctx, slots)
    _, own = decode.greedy(ctx, layers, decode.next_position(ctx, slots), QUERY, 6, decode.eos_ids(ctx))
    assert hf.token_ids == own


# ----------------------------------------------------------------------------- slide / survivors


@pytest.mark.parametrize("policy", ["eager", "none"])
def test_slide_survivors_only_relocate(backend, policy):
    win = ContextWindow(backend, patch_policy=policy, rank=2)
    refs = [win.append(token_ids=x) for x in (A, B, C, D)]
    lay = backend.layout
    content = {}
    for r in refs[1:]:
        s = win.slot(r)
        content[r] = (s.patches, to_content_frame(list(s.page), lay, s.positions()))
    receipt = win.slide()
    assert receipt.forwards == 0 and receipt.encodes == 0 and receipt.patches_formed == 0
    assert receipt.left == (refs[0],) and receipt.pages_written == 3
    for r in refs[2:]:
        s = win.slot(r)
        assert s.patches == content[r][0]  # same patch objects: kept as-is
        k, v = to_content_frame(list(s.page), lay, s.positions())
        assert torch.allclose(k, content[r][1][0], atol=1e-5) and torch.allclose(v, content[r][1][1], atol=1e-5)
    head = win.slot(refs[1])  # every antecedent it had left: at the front its canonical is exact
    k, v = to_content_frame(list(head.page), lay, head.positions())
    if policy == "eager":  # it dropped the patch formed for A, for free
        assert content[refs[1]][0] and head.patches == ()
        c = win.chunk(refs[1])
        assert torch.allclose(k, c.keys.float(), atol=1e-5) and torch.allclose(v, c.values.float(), atol=1e-5)
    else:  # blind everywhere: nothing to drop
        assert head.patches == content[refs[1]][0] == ()
    starts = [st for _, st, _ in win.placement()]
    assert starts[0] == backend.root_len


def test_default_slide_with_removal_rank_stacks_a_removal_patch(backend):
    from contextdeque.window import DefaultPolicy

    win = ContextWindow(backend, patch_policy=DefaultPolicy(removal_rank=2), rank=2)
    refs = [win.append(token_ids=x) for x in (A, B, C)]
    receipt = win.slide()
    assert receipt.patches_formed == 1  # C loses A but keeps B: one removal patch; B is at the front
    kinds = [p.kind for p in win.patches(refs[2])]
    assert kinds == ["exact", "removal"]


def test_append_seen_content_never_encodes_again(backend):
    store = TieredStore([MemoryTier("cpu", None, name="device"), HostTier(None, name="host")])
    win = ContextWindow(backend, store=store, rank=2)
    first = win.append(token_ids=A)
    assert first.receipt.encodes == 1
    again = win.append(token_ids=A)  # same content, second occurrence: a new ref, no encode
    assert again.receipt.encodes == 0 and again != first
    other = ContextWindow(backend, store=store, rank=2)
    assert other.append(token_ids=A).receipt.encodes == 0


# ----------------------------------------------------------------------------- evict / recall


def test_evict_demotes_and_recall_rehydrates_with_a_fresh_patch(backend):
    store = TieredStore([MemoryTier("cpu", None, name="device"), HostTier(None, name="host")])
    win = ContextWindow(backend, store=store, rank=2, patch_policy="eager")
    a, b, c = (win.append(token_ids=x) for x in (A, B, C))
    key = WindowStore.chunk_key(win.chunk(b))
    stale = win.patches(b)
    assert [p.kind for p in stale] == ["exact"] and stale[0].antecedents == (a.chunk_id,)
    ev = win.evict(b)
    assert ev.forwards == 0 and win.refs == (a, c) and win.evicted_refs == (b,)
    assert win.store.tier_of(key) == "host"
    assert ev.bytes_moved.get("host", 0) > 0
    win.slide()  # turn the window over: b's old antecedent a is gone
    rc = win.recall(b, at="end")
    assert rc.encodes == 0 and rc.forwards == 1 and rc.patches_formed == 1
    assert win.refs == (c, b)
    fresh = win.patches(b)
    assert [p.kind for p in fresh] == ["recall"]
    assert fresh[0].antecedents == (c.chunk_id,)  # formed on what precedes it now
    assert fresh[0].id != stale[0].id
    assert win.store.tier_of(key) == "device"
    assert rc.bytes_moved.get("host", 0) > 0  # read back from the lower tier


def test_recall_into_the_middle_and_budget(backend):
    win = ContextWindow(backend, budget_tokens=16, rank=2)
    a, b, c = (win.append(token_ids=x) for x in (A, B, C))  # 13 tokens
    win.evict(a)
    r = win.recall(a, at=1)
    assert win.refs == (b, a, c)
    assert [st for _, st, _ in win.placement()] == [2, 5, 9]
    d = win.append(token_ids=D)  # 13 + 5 > 16: the oldest slides out
    assert d.receipt.left == (b,) and win.refs == (a, c, d) and win.tokens_used == 15
    assert b in win.evicted_refs
    assert r.op == "recall"


def test_recall_from_a_disk_tier(backend, tmp_path):
    store = TieredStore([MemoryTier("cpu", None, name="device"), DiskTier(tmp_path / "store", None, name="disk")])
    win = ContextWindow(backend, store=store, patch_policy="exact")
    a, b = win.append(token_ids=A), win.append(token_ids=B)
    win.evict(a)
    assert win.store.tier_of(WindowStore.chunk_key(a.chunk_id, backend.fingerprint)) == "disk"
    rc = win.recall(a, at="end")
    assert rc.encodes == 0 and rc.bytes_moved.get("disk", 0) > 0
    assert cache_err(win.materialize(), reprefill(backend, window_ids(win))) < 2e-5


# ----------------------------------------------------------------------------- graph and cascades


def cascade_window(backend, cascade):
    win = ContextWindow(backend, rank=2, cascade_policy=cascade, patch_policy="eager")
    x, r, b = (win.append(token_ids=t) for t in (A, B, C))
    return win, x, r, b


def test_graph_records_conditioning(backend):
    win, x, r, b = cascade_window(backend, "reform")
    g = win.graph
    assert isinstance(g, ConditioningGraph) and isinstance(g.g, nx.DiGraph)
    assert set(g.g.edges()) == {(x, r), (x, b), (r, b)}
    assert g.dependents(r) == [b] and set(g.antecedents(b)) == {x, r}
    assert win.cascade_preview(x) == (r, b)


def test_recall_reports_and_reforms_the_cascade(backend):
    win, x, r, b = cascade_window(backend, "reform")
    win.evict(r)  # b survives, keeping what it absorbed from r
    assert [p.antecedents for p in win.patches(b)] == [(x.chunk_id, r.chunk_id)]
    rc = win.recall(r, at="end")  # r comes back behind b: b was conditioned on a state of r that is gone
    assert rc.cascade.direct == (b,) and rc.cascade.implied == (b,) and rc.cascade.reformed == (b,)
    assert [p.antecedents for p in win.patches(b)] == [(x.chunk_id,)]
    assert win.refs == (x, b, r) and win.stale_refs == ()
    assert win.graph.stale_edges() == []


def test_recall_cascade_keep_and_flag(backend):
    win, x, r, b = cascade_window(backend, "keep")
    win.evict(r)
    held = win.patches(b)
    rc = win.recall(r, at="end")
    assert rc.cascade.implied == (b,) and rc.cascade.reformed == () and win.patches(b) == held

    win, x, r, b = cascade_window(backend, "flag")
    win.evict(r)
    rc = win.recall(r, at="end")
    assert rc.cascade.flagged == (b,) and win.stale_refs == (b,)
    fixed = win.refresh()
    assert fixed.patches_formed == 1 and win.stale_refs == ()


def test_recall_at_the_same_place_with_unchanged_state_cascades_nothing(backend):
    win = ContextWindow(backend, rank=2)
    r, b = win.append(token_ids=A), win.append(token_ids=B)  # r first: its KV is the canonical
    win.evict(r)
    rc = win.recall(r, at=0)
    assert rc.cascade.implied == () and rc.forwards == 0


def test_transitive_cascade(backend):
    win = ContextWindow(backend, rank=2, patch_policy="eager")
    x, r, b = (win.append(token_ids=t) for t in (A, B, C))
    win.evict(r)
    c = win.append(token_ids=D)  # conditioned on b (which carries r's influence), not on r
    rc = win.recall(r, at="end")
    assert win.refs == (x, b, c, r)
    assert rc.cascade.direct == (b,)
    assert rc.cascade.implied == (b, c) and rc.cascade.reformed == (b, c)


def test_a_chunk_the_recall_is_inserted_before_keeps_its_conditioning(backend):
    """Recalled into the middle on a new prefix (its state changes), r cascades to b (now in front
    of it: b's patch names r, which sits after it). c, which r is inserted before, is carried out
    as its own decision says (a stored patch on its new prefix, else it keeps what it carries, as
    a survivor does): no forward for it, and its patch is the one it had."""
    win = ContextWindow(backend, rank=2, patch_policy="eager")
    x, r, b, c = (win.append(token_ids=t) for t in (A, B, C, D))
    before = [p.antecedents for p in win.patches(c)]
    win.evict(r)
    rc = win.recall(r, at=2)
    assert win.refs == (x, b, r, c) and b in rc.cascade.reformed and c not in rc.cascade.reformed
    assert [p.antecedents for p in win.patches(c)] == before == [(x.chunk_id, r.chunk_id, b.chunk_id)]


def test_recall_with_an_identical_fresh_patch_cascades_nothing(backend):
    """Recalled onto the very antecedent states it was conditioned on, the fresh patch equals
    the old conditioning: its dependents are not stale. Exact and recall patches share one store
    namespace (same measurement), so the patch stored at append serves the recall: no forward."""
    win = ContextWindow(backend, rank=2, patch_policy="eager")
    x, r, b, c = (win.append(token_ids=t) for t in (A, B, C, D))
    win.evict(r)
    rc = win.recall(r, at=1)
    assert rc.cascade.implied == () and rc.forwards == 0 and rc.patches_reused == 1


# ----------------------------------------------------------------------------- reorder


def test_reorder_uses_an_orbit_patch_once_formed(backend):
    win = ContextWindow(backend, rank=2, patch_policy="eager")
    a, b, c = (win.append(token_ids=t) for t in (A, B, C))
    first = win.reorder([b, a, c])  # c's antecedent set is unchanged: orbit formed (2 orderings)
    assert [p.kind for p in win.patches(c)] == ["orbit"]
    assert first.forwards >= 2
    again = win.reorder([a, b, c])  # same set for c: the stored orbit patch serves it
    assert [p.kind for p in win.patches(c)] == ["orbit"]
    assert "reused" in " ".join(n for n in again.notes if n.startswith(f"#{c.key}:"))


def test_reorder_identity_is_free(backend):
    win = ContextWindow(backend, rank=2)
    refs = [win.append(token_ids=t) for t in (A, B, C)]
    rc = win.reorder(list(refs))
    assert rc.forwards == 0 and rc.pages_written == 0 and rc.total_bytes_moved == 0


# ----------------------------------------------------------------------------- forks


def test_fork_is_copy_on_write_and_never_changes_its_parent(backend):
    win = ContextWindow(backend, rank=2)
    refs = [win.append(token_ids=t) for t in (A, B, C)]
    before = snapshot(win)
    child = win.fork()
    fk = win.last_receipt
    assert fk.op == "fork" and fk.forwards == 0 and fk.total_bytes_moved == 0
    for r in refs:  # pages are shared, not copied
        assert all(k1.data_ptr() == k2.data_ptr() for (k1, _), (k2, _) in zip(child.kv(r), win.kv(r)))
    child.slide()
    child.append(token_ids=D)
    child.reorder(list(reversed(child.refs)))
    child.evict(child.refs[0])
    assert_same_snapshot(before, snapshot(win))
    assert child.parent is win
    with pytest.raises(WindowError):
        win.commit()


def test_fork_commit_and_discard(backend):
    win = ContextWindow(backend, rank=2)
    a, b = win.append(token_ids=A), win.append(token_ids=B)
    child = win.fork()
    c = child.append(token_ids=C)
    child.commit()
    assert win.refs == (a, b, c) and child.closed
    with pytest.raises(WindowError):
        child.append(token_ids=D)

    other = win.fork()
    other.slide(2)
    other.discard()
    assert win.refs == (a, b, c)

    stale = win.fork()
    win.slide()  # parent moves on: the fork's commit would lose that
    with pytest.raises(WindowError):
        stale.commit()
    assert win.refs == (b, c)


def test_a_heal_step_with_nothing_left_is_a_no_op(backend):
    """The idle healer checks for pending chunks, then runs a step: a foreground heal may have
    healed them in between. That step is an empty transaction, not an error."""
    win = ContextWindow(backend, rank=2, patch_policy="latency")
    win.append(token_ids=A), win.append(token_ids=B)
    win.heal()
    assert not win.pending_refs
    before = win.refs
    assert win._heal_step().refs == () and win.refs == before


def test_fork_keeps_shared_canonicals_resident(backend):
    win = ContextWindow(backend, rank=2)
    a, b = win.append(token_ids=A), win.append(token_ids=B)
    child = win.fork()
    child.evict(a)  # the parent still holds a: its canonical stays in the fast tier
    key = WindowStore.chunk_key(a.chunk_id, backend.fingerprint)
    assert win.store.tier_of(key) == "device"
    child.discard()
    win.evict(a)
    assert win.store.tier_of(key) == "host"


# ----------------------------------------------------------------------------- disposability


def test_is_disposable_verdict(backend):
    win = ContextWindow(backend, rank=2)
    a, b, c = (win.append(token_ids=t) for t in (A, B, C))
    before = snapshot(win)
    v = win.is_disposable(a, QUERY, max_new_tokens=4, drop=True)
    # a has nothing in front of it: its conditioning is the canonical, toggling is a no-op
    assert not v.had_conditioning and v.kl_unconditioned == 0.0 and v.answer_unconditioned == v.answer_as_is
    assert v.answer_dropped is not None and v.kl_dropped is not None and v.kl_dropped > 0.0  # dropping a changes the context
    assert v.receipt.forwards >= 3 and v.receipt.op == "is_disposable"
    w = win.is_disposable(c, QUERY, max_new_tokens=4)
    assert w.had_conditioning and w.kl_unconditioned > 0.0
    assert bool(w) == w.disposable == (w.answer_unconditioned == w.answer_as_is)
    assert_same_snapshot(before, snapshot(win))
    # the dropped variant is what the window decodes after evicting a (b, now at the front, on its
    # canonical; c kept as-is)
    win.evict(a)
    assert win.generate(QUERY, max_new_tokens=4).token_ids == v.answer_dropped


# ----------------------------------------------------------------------------- errors


def test_typed_errors_and_nothing_lost(backend, other_backend):
    win = ContextWindow(backend, budget_tokens=12, rank=2)
    a, b = win.append(token_ids=A), win.append(token_ids=B)
    win.evict(a)
    before = snapshot(win)
    stranger = ChunkRef(key=10**9, chunk_id="x" * 32, n_tokens=3)
    with pytest.raises(UnknownRefError):
        win.evict(stranger)
    with pytest.raises(UnknownRefError):
        win.recall(stranger)
    with pytest.raises(WindowError):
        win.evict(a)  # already evicted
    with pytest.raises(WindowError):
        win.recall(b)  # in the window
    with pytest.raises(WindowError):
        win.reorder([b, a])  # a is not in the window
    with pytest.raises(WindowError):
        win.reorder([b, b])
    with pytest.raises(WindowError):
        win.slide(5)
    with pytest.raises(WindowError):
        win.recall(a, at=7)
    with pytest.raises(BudgetError):
        win.append(token_ids=list(range(4, 17)))  # 13 tokens > budget 12
    with pytest.raises(FingerprintMismatchError):
        win.append(chunk=other_backend.encode(token_ids=C))
    with pytest.raises(WindowError):
        win.append(token_ids=A, text="both")
    with pytest.raises(WindowError):
        win.append()
    assert_same_snapshot(before, snapshot(win))
    win.purge(a)
    with pytest.raises(UnknownRefError):
        win.recall(a)
    with pytest.raises(UnknownRefError):
        win.purge(a)
    assert win.refs == (b,)


def test_budget_and_configuration_errors(backend):
    with pytest.raises(BudgetError):
        ContextWindow(backend, budget_tokens=0)
    with pytest.raises(WindowError):
        ContextWindow(backend, patch_policy="bogus")
    with pytest.raises(WindowError):
        ContextWindow(backend, cascade_policy="bogus")
    win = ContextWindow(backend, budget_tokens=8, overflow="error", rank=2)
    win.append(token_ids=A)
    with pytest.raises(BudgetError):
        win.append(token_ids=D)
    assert win.tokens_used == 4


def test_chunk_from_another_root_is_refused(backend):
    rooted = ContextWindow(backend, root=[1, 3, 4], rank=2)
    assert rooted.root_ids == (1, 3, 4)
    assert rooted.backend.root_digest != backend.root_digest
    with pytest.raises(FingerprintMismatchError):
        rooted.append(chunk=backend.encode(token_ids=A))
    r = rooted.append(token_ids=A)
    assert r.chunk_id != backend.encode(token_ids=A).id
    assert rooted.placement()[0][1] == 3


def test_receipt_fields(backend):
    win = ContextWindow(backend, rank=2)
    r = win.append(token_ids=A)
    rc = r.receipt
    assert isinstance(rc, Receipt) and rc.op == "append" and rc.refs == (r,)
    assert rc.encodes == 1 and rc.forwards >= 1 and rc.tokens_prefilled >= len(A)
    assert rc.bytes_moved.get("device", 0) > 0 and rc.bytes_moved.get("pages", 0) > 0 and rc.wall_ms > 0
    d = rc.as_dict()
    assert d["op"] == "append" and d["refs"] == [r.key]
    assert "append" in rc.summary()
    assert win.last_receipt is rc


# ----------------------------------------------------------------------------- real default model


@pytest.mark.slow
def test_real_model_slide_recall_generate(default_backend):
    from pydoc_data.topics import topics

    texts = [topics[k][:240] for k in ("assert", "pass", "del")]
    win = ContextWindow(default_backend, patch_policy="exact", rank=32)
    refs = [win.append(t) for t in texts]
    assert all(r.receipt.encodes == 1 for r in refs)
    ref_kv = reprefill(default_backend, window_ids(win))
    scale = max(float(k.abs().max()) for k, _ in ref_kv)
    assert cache_err(win.materialize(), ref_kv) < 2e-6 * scale * 64
    s = win.slide()
    assert s.encodes == 0 and s.left == (refs[0],)
    rc = win.recall(refs[0], at="end")
    assert rc.encodes == 0 and rc.forwards == 1
    assert cache_err(win.materialize(), reprefill(default_backend, window_ids(win))) < 2e-6 * scale * 64
    answer = win.generate("Which statement does nothing?", max_new_tokens=6)
    assert isinstance(answer.text, str) and answer.token_ids


# ----------------------------------------------------------------------------- window-bench


def test_window_bench_reports_a_copy_free_fork(capsys):
    """The benchmark runs through the CLI and reports its measurements (no timing asserted)."""
    import json

    from contextdeque.cli import main

    rc = main(["window-bench", "--model", "tiny", "--runs", "1", "--chunks", "3", "--chunk-tokens", "16", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["window"] == "3x16"
    assert out["fork_bytes_copied"] == 0 and out["fork_bytes_moved"] == 0
    assert out["slide_forwards"] == 0 and out["slide_pages_written"] == 2
    assert out["fork_bytes_copied_after_child_slide"] == out["child_slide_pages_bytes"] > 0
    for key in ("slide_ms", "fork_ms", "materialize_ms", "reprefill_ms"):
        assert out[key] > 0  # each was measured (a duration, no threshold)


# ----------------------------------------------------------------------------- embeddings chunks


def test_embeddings_chunks_and_spans(backend):
    """An ``embeds=`` chunk (an image span's input embeddings) is placed like any other; one
    whose span differs from its token count cannot be continued by ``model.generate``, so
    ``input_ids_for`` refuses and ``generate`` decodes with explicit positions instead."""
    win = ContextWindow(backend, patch_policy="exact")
    win.append(token_ids=A)
    emb = backend.embed_tokens(torch.tensor(B))
    e = win.append(embeds=emb)
    assert win.chunk(e).modality == "image" and win.chunk(e).token_ids is None
    ref = backend.forward(input_ids=list(backend.root_ids) + A + B,
                          positions=backend.text_positions(0, backend.root_len + len(A) + len(B)), logits="none").kv
    assert cache_err(win.materialize(), ref) < 2e-5
    assert win.input_ids_for(QUERY).shape[1] == backend.root_len + len(A) + len(B) + len(QUERY)

    grid = ContextWindow(backend, rank=2)
    g = grid.append(embeds=emb, rel_positions=torch.tensor([0, 0, 1]), span=4)  # a 3-token span advancing 4
    assert grid.next_position() == backend.root_len + 4 and grid.placement() == [(g, backend.root_len, backend.root_len + 4)]
    with pytest.raises(WindowError):
        grid.input_ids_for(QUERY)
    assert len(grid.generate(QUERY, max_new_tokens=3).token_ids) == 3


# ----------------------------------------------------------------------------- multimodal


def test_image_chunks_never_rerun_the_vision_tower(tiny_backend_factory):
    """The store keeps a VL model's encoder output keyed by pixels + processor settings: the same
    screenshot appended again (after a purge, or by another window sharing the store) runs
    neither the vision tower nor the chunk encode; the relocated image chunk equals the model's
    own placement of those embeddings."""
    from skimage import data

    from contextdeque.model.testing import build_tiny_vl_processor
    from contextdeque.model.vision import encode_image
    from contextdeque.stores import HostTier, TieredStore

    backend = tiny_backend_factory("qwen2_vl")
    proc = build_tiny_vl_processor("qwen2_vl")
    img = data.astronaut()
    store = TieredStore([HostTier(None)])
    win = ContextWindow(backend, budget_tokens=200, rank=4, store=store, patch_policy="eager")
    win.append(token_ids=[5, 6, 7, 8])
    ref = win.append(image=img, processor=proc)
    assert win._ctx.counters.vision_encodes == 1
    assert win.placement()[-1][0] == ref
    direct = encode_image(backend, img, proc)
    assert ref.chunk_id == direct.id  # same canonical as encoding the image directly
    win.evict(ref)
    win.purge(ref)
    encodes = win._ctx.counters.encodes
    again = win.append(image=img, processor=proc)
    assert win._ctx.counters.vision_encodes == 1 and win._ctx.counters.encodes == encodes
    other = ContextWindow(backend, budget_tokens=200, rank=4, store=store, patch_policy="eager")
    other.append(image=img, processor=proc)
    assert other._ctx.counters.vision_encodes == 0 and other._ctx.counters.encodes == 0
    with pytest.raises(WindowError):
        win.append(image=img)  # no processor
    assert again.chunk_id == ref.chunk_id
