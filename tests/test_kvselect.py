"""Decode-aware KV selection (MM-ShiftKV) and its baselines (SnapKV, StreamingLLM): rebuilt
queries equal the model's, selections keep what they promise, a budget >= the window equals full
KV, bad input is refused, the patch composes by its left-factor rows, and the window policy."""

from __future__ import annotations

import pytest
import torch
from helpers import seeded_ids

from contextdeque import ContextWindow, form_patch, relocate
from contextdeque.core.errors import SelectionError, SelectionTypeError, WindowError
from contextdeque.window import kvselect as ks
from contextdeque.window.kvselect import (
    SELECTORS,
    MMShiftKVSelector,
    QueryModel,
    SelectionPolicy,
    apply_rows,
    attention_coverage,
    make_selector,
    select_window_kv,
    traced_prefill,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _trace(be, n: int = 60, seed: int = 0, past=None, start: int = 0):
    ids = seeded_ids(n, seed)
    if past is None:
        ids = torch.cat([torch.tensor(be.root_ids), ids])
        return traced_prefill(be, input_ids=ids, positions=be.text_positions(0, ids.numel()))
    return traced_prefill(be, input_ids=ids, positions=be.text_positions(start, n), past=past)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text", "phi", "stablelm", "cohere", "qwen3_vl"])
def test_rebuilt_queries_reproduce_the_models_attention(tiny_backend_factory, arch):
    """softmax(q K^T * scaling) V with our queries equals what each layer's attention handed o_proj
    (q bias, q-norm, partial / interleaved rotary, M-RoPE text positions, query scaling)."""
    be = tiny_backend_factory(arch)
    outs: list[torch.Tensor] = []
    hooks = [getattr(a, "o_proj", None) or a.dense
             for a in ks._attention_modules(be.model)]
    hooks = [m.register_forward_pre_hook(lambda m, a: outs.append(a[0].detach().reshape(-1, a[0].shape[-1]).float()))
             for m in hooks]
    try:
        tr = _trace(be, 40)
    finally:
        for h in hooks:
            h.remove()
    qm = QueryModel(be)
    S = tr.n_rows
    for layer in range(tr.num_layers):
        q = qm.queries(layer, tr.hidden[layer], tr.positions)
        p = qm.probs(layer, q, tr.kv[layer][0], qm.visible(layer, torch.arange(S), S))
        o = (p @ tr.kv[layer][1].float().repeat_interleave(qm.group, 0)).transpose(0, 1).reshape(S, -1)
        assert torch.allclose(o, outs[layer], atol=2e-5, rtol=1e-4), (arch, layer, float((o - outs[layer]).abs().max()))


def test_mla_is_refused(tiny_backend_factory):
    from contextdeque.core.errors import UnsupportedLayoutError

    with pytest.raises(UnsupportedLayoutError):
        QueryModel(tiny_backend_factory("deepseek_v3"))


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_budget_at_or_above_the_window_keeps_everything_and_equals_full_kv(tiny_backend_factory, name):
    be = tiny_backend_factory("llama")
    tr = _trace(be, 50)
    qm = QueryModel(be)
    sels = make_selector(name).select_many(tr, [tr.n_rows, tr.n_rows + 7, 10_000], qm)
    for sel in sels.values():
        assert sel.keeps_everything and sel.kept == tr.n_rows
        for (k, v), (k2, v2) in zip(sel.gather(tr.kv), tr.kv):
            assert torch.equal(k, k2) and torch.equal(v, v2)
    # decoding over the "selected" KV is decoding over the full KV, bit for bit
    cont = seeded_ids(5, 9)
    pos = be.text_positions(tr.next_position, 5)
    full = be.forward(input_ids=cont, positions=pos, past=tr.kv, logits="all").logits
    sel = be.forward(input_ids=cont, positions=pos, past=sels[tr.n_rows].gather(tr.kv), logits="all").logits
    assert torch.equal(full, sel)


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_selections_keep_budget_rows_per_head_in_temporal_order(tiny_backend_factory, name):
    be = tiny_backend_factory("llama")
    tr = _trace(be, 70)
    qm = QueryModel(be)
    S = tr.n_rows
    for budget, sel in make_selector(name).select_many(tr, [1, 5, 16, 40], qm).items():
        assert sel.kept == budget and not sel.keeps_everything
        for idx in sel.index:
            assert idx.shape == (be.layout.k_heads, budget)
            assert bool((idx[:, 1:] > idx[:, :-1]).all()) and int(idx.min()) >= 0 and int(idx.max()) < S
        gathered = sel.gather(tr.kv)
        assert gathered[0][0].shape[1] == budget
        if name == "mm-shiftkv":
            assert bool((sel.index[0][:, -1] == S - 1).all())  # the last row is always kept
        if name == "streamingllm" and budget >= 5:
            want = torch.cat([torch.arange(4), torch.arange(S - budget + 4, S)])
            assert all(torch.equal(row, want) for idx in sel.index for row in idx)
        if name == "snapkv" and budget <= 32:
            assert all(torch.equal(row, torch.arange(S - budget, S)) for idx in sel.index for row in idx)
        if name == "snapkv" and budget == 40:
            assert all(bool((row[-32:] == torch.arange(S - 32, S)).all()) for idx in sel.index for row in idx)


def test_bad_budgets_and_selectors_are_refused(tiny_backend_factory):
    be = tiny_backend_factory("llama")
    tr = _trace(be, 20)
    qm = QueryModel(be)
    sel = make_selector("mm-shiftkv")
    with pytest.raises(SelectionError, match="budget"):
        sel.select(tr, 0, qm)
    with pytest.raises(SelectionError):
        sel.select(tr, -3, qm)
    with pytest.raises(SelectionTypeError):
        sel.select(tr, "64", qm)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        sel.select(tr, 2.5, qm)  # type: ignore[arg-type]
    with pytest.raises(SelectionError, match="unknown KV selector"):
        make_selector("h2o")
    with pytest.raises(SelectionError):
        MMShiftKVSelector(proxies=100, groups=32)
    with pytest.raises(SelectionError):
        MMShiftKVSelector(tau=1.0)
    with pytest.raises(ValueError):
        SelectionPolicy(budget=0)


def test_mm_shiftkv_votes_take_the_smallest_set_holding_tau_of_each_groups_mass():
    sel = MMShiftKVSelector(proxies=4, groups=2, tau=0.75)
    mass = torch.tensor([[[0.5, 0.3, 0.1, 0.1], [0.1, 0.1, 0.2, 0.6]]])  # [H=1, G=2, S=4]
    # group 0: 0.5 < 0.75, 0.8 >= 0.75 -> rows {0, 1}; group 1: 0.6, 0.8 -> rows {3, 2}
    assert sel.votes(mass).tolist() == [[1.0, 1.0, 1.0, 1.0]]
    mass = torch.tensor([[[0.9, 0.05, 0.05, 0.0], [0.8, 0.1, 0.1, 0.0]]])
    assert sel.votes(mass).tolist() == [[2.0, 0.0, 0.0, 0.0]]


def test_mm_shiftkv_defaults_are_the_papers_and_selection_is_deterministic(tiny_backend_factory):
    s = MMShiftKVSelector()
    assert (s.proxies, s.groups, s.gamma, s.tau, s.lam) == (512, 32, 10.0, 0.95, 1.0)
    be = tiny_backend_factory("llama")
    tr = _trace(be, 60)
    qm = QueryModel(be)
    a, b = s.select(tr, 12, qm), MMShiftKVSelector().select(tr, 12, qm)
    assert all(torch.equal(x, y) for x, y in zip(a.index, b.index))
    c = MMShiftKVSelector(seed=1).select(tr, 12, qm)
    assert any(not torch.equal(x, y) for x, y in zip(a.index, c.index))  # the proxies are what votes


def test_coverage_is_one_with_everything_kept_and_falls_with_the_budget(tiny_backend_factory):
    be = tiny_backend_factory("llama")
    tr = _trace(be, 80)
    qm = QueryModel(be)
    cont = seeded_ids(4, 3)
    dec = traced_prefill(be, input_ids=cont, positions=be.text_positions(tr.next_position, 4), past=tr.kv)
    sels = make_selector("streamingllm").select_many(tr, [8, 40, tr.n_rows], qm)
    cov = {b: attention_coverage(qm, dec, tr.n_rows, s) for b, s in sels.items()}
    assert cov[tr.n_rows] == pytest.approx(1.0, abs=1e-6)
    assert 0.0 < cov[8] < cov[40] < 1.0


def test_apply_rows_is_the_gathered_patched_page(tiny_backend_factory):
    """The kept rows of a relocated, patched chunk from its canonical's rows plus the patch's
    left-factor rows, without placing the rest."""
    be = tiny_backend_factory("llama")
    a = be.encode(token_ids=seeded_ids(24, 1))
    b = be.encode(token_ids=seeded_ids(30, 2))
    patch = form_patch(be, b, antecedents=[a], rank=8)
    start = 57
    full = relocate(b, start, patch=patch)
    g = torch.Generator().manual_seed(0)
    rows = [[torch.sort(torch.randperm(30, generator=g)[: 5 + h + l]).values for h in range(be.layout.k_heads)]
            for l in range(b.num_layers)]
    got = apply_rows(b, start, rows, [patch])
    blind = apply_rows(b, start, rows)
    ref_blind = relocate(b, start)
    for l in range(b.num_layers):
        for h, idx in enumerate(rows[l]):
            assert torch.allclose(got[l][h][0], full[l][0][h, idx], atol=1e-5, rtol=1e-5)
            assert torch.allclose(got[l][h][1], full[l][1][h, idx], atol=1e-5, rtol=1e-5)
            assert torch.allclose(blind[l][h][0], ref_blind[l][0][h, idx], atol=1e-6)
    with pytest.raises(SelectionError):
        apply_rows(b, start, rows[:1])
    with pytest.raises(SelectionError):
        apply_rows(b, start, [[torch.tensor([30])] * be.layout.k_heads for _ in range(b.num_layers)])


def _window(be, policy=None):
    win = ContextWindow(be, rank=8, kv_selection=policy, patch_policy="eager")  # patches formed on append
    for s in (11, 12, 13):
        win.append(token_ids=seeded_ids(20, s))
    return win


def test_window_policy_composes_with_the_patch_by_left_factor_rows(tiny_backend_factory):
    be = tiny_backend_factory("llama")
    win = _window(be)
    ctx, slots = win.context, win._state.slots
    assert any(s.patches for s in slots)
    from contextdeque.window import decode

    q = seeded_ids(6, 20).tolist()
    layers = decode.assemble(ctx, slots)
    tr = traced_prefill(be, input_ids=q, positions=be.text_positions(win.next_position(), 6), past=layers)
    sel = make_selector("mm-shiftkv").select(tr, 17, QueryModel(be))
    got = select_window_kv(ctx, slots, tr, sel)
    want = sel.gather(tr.kv)
    for (k, v), (k2, v2) in zip(got, want):
        assert k.shape == k2.shape == (be.layout.k_heads, 17, be.layout.k_dim)
        assert torch.allclose(k, k2, atol=1e-5, rtol=1e-5) and torch.allclose(v, v2, atol=1e-5, rtol=1e-5)


def test_window_policy_under_memory_pressure(tiny_backend_factory):
    be = tiny_backend_factory("llama")
    q = seeded_ids(6, 20).tolist()
    plain = _window(be).generate(q, max_new_tokens=6, chat=False)
    roomy = _window(be, SelectionPolicy("mm-shiftkv", budget=4096)).generate(q, max_new_tokens=6, chat=False)
    assert roomy.token_ids == plain.token_ids
    assert any("under its threshold" in n for n in roomy.receipt.notes)
    for name in SELECTORS:
        tight = _window(be, SelectionPolicy(name, budget=24)).generate(q, max_new_tokens=6, chat=False)
        assert len(tight.token_ids) >= 1
        assert tight.token_ids[0] == plain.token_ids[0]  # the first token comes from the full prefill
        assert any(f"{name}@24: kept 24 of" in n for n in tight.receipt.notes)
    with pytest.raises(WindowError):
        ContextWindow(be, kv_selection="mm-shiftkv")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- arms and the harness group


def test_selection_arms(tiny_backend_factory):
    from contextdeque.eval.arms import ARMS, ReuseRequest, make_arm
    from contextdeque.core.errors import ReuseArmError

    be = tiny_backend_factory("llama")
    chunks = [be.encode(token_ids=seeded_ids(40, s)) for s in (31, 32, 33)]
    req = ReuseRequest(be, chunks, query_ids=seeded_ids(5, 34).tolist())
    full = make_arm("reprefill").run(req)
    for name in ("mm-shiftkv", "snapkv", "streamingllm"):
        assert name in ARMS
        roomy = make_arm(name, budget=10_000).run(req)
        assert roomy.report.arm == f"{name}-10000" and roomy.selection.keeps_everything
        assert roomy.next_position == req.next_position + 5
        for (k, v), (k2, v2) in zip(roomy.kv, full.kv):  # the chunks' rows are the full re-prefill's
            assert torch.allclose(k[:, : k2.shape[1]], k2, atol=1e-5) and torch.allclose(v[:, : v2.shape[1]], v2, atol=1e-5)
        tight = make_arm(name, budget=12).run(req)
        assert tight.kv[0][0].shape[1] == 12 and tight.report.extras["kept_rows"] == 12
        assert tight.report.extras["kv_bytes_kept"] < tight.report.extras["kv_bytes_full"]
        on_patch = make_arm(name, budget=12, base="patch").run(req)
        assert on_patch.kv[0][0].shape[1] == 12 and on_patch.report.forwards == 1
    with pytest.raises(ReuseArmError, match="query_ids"):
        make_arm("mm-shiftkv", budget=8).run(ReuseRequest(be, chunks))
    with pytest.raises(SelectionError):
        make_arm("snapkv", budget=0)


def test_harness_select_group(tiny_backend_factory):
    from contextdeque.eval.fidelity.harness import HarnessConfig, run_fidelity
    from contextdeque.eval.fidelity.probes import probe_set

    be = tiny_backend_factory("llama", seed=0)
    items = [i for i in probe_set() if i.id == "binding-03"]
    cfg = HarnessConfig(ranks=(4,), arms=("patch", "select"), max_chunk_tokens=14, max_decode=3, select_budgets=(6, 20, 4096))
    s = run_fidelity(be, items, cfg).summary
    assert s["n_samples"]["select"] == 1
    arms = s["arms"]
    for m in ("mm-shiftkv", "snapkv", "streamingllm"):
        assert arms[f"{m}-4096"]["median_kl"] == pytest.approx(0.0, abs=1e-9)
        assert arms[f"{m}-4096"]["median_coverage"] == pytest.approx(1.0, abs=1e-6)
        assert arms[f"{m}-4096"]["agreement"] == 1.0
        assert arms[f"{m}-6"]["median_coverage"] < 1.0 and arms[f"{m}-6"]["median_kl"] > 0.0
    assert "patch-r32+allrows" in arms and "mm-shiftkv-6+patch-r32" in arms


@pytest.mark.parametrize("argv", [["--select-budgets", "0"], ["--select-budgets", "64,-1"], ["--select-budgets", "x"],
                                  ["--capsule-retention", "0"], ["--capsule-retention", "1.5"]])
def test_fidelity_cli_refuses_a_zero_budget_or_retention_before_loading_a_model(argv, capsys):
    from contextdeque.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["fidelity", "--model", "no/such/model", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert ("integers" in err or "expected a number" in err or "in (0, 1]" in err) and "Traceback" not in err
