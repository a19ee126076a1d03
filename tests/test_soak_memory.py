"""Issue 10: memory stays bounded over a long run. Everything a window accumulates per operation
has a configured cap — evicted refs (``max_evicted``), the conditioning graph (only what the
window depends on), the stored-prefix hint, receipts — and an evicted chunk that left before
healing keeps no KV. A soak checks the bounds from the configuration, not from wall time."""

from __future__ import annotations

import pytest
from helpers import micro_llama, seeded_ids

from contextdeque.core.errors import UnknownRefError
from contextdeque.eval.soak import run_soak
from contextdeque.model.hf import HFBackend
from contextdeque.window import ContextWindow, WindowConfig
from contextdeque.window.context import PATCH_INDEX_CHUNKS, PATCH_INDEX_PREFIXES
from contextdeque.window.prepared import MAX_BYTES, MAX_ENTRIES


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    return HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-soak-llama")


def test_max_evicted_forgets_the_oldest(backend, one_thread):
    win = ContextWindow(backend, budget_tokens=12, rank=2, max_evicted=3, patch_policy="eager")
    refs = [win.append(token_ids=seeded_ids(6, 10 + i, vocab=60).tolist()) for i in range(9)]
    assert len(win.evicted_refs) == 3 and set(win.evicted_refs) == set(refs[4:7])
    assert any("forgot" in n and "max_evicted=3" in n for r in win.receipts for n in r.notes)
    with pytest.raises(UnknownRefError):
        win.recall(refs[0])
    assert win.recall(refs[5]).encodes == 0
    assert len(win.graph) <= len(win) + 3
    with pytest.raises(ValueError, match="max_evicted"):
        ContextWindow(backend, max_evicted=-1)


def test_a_chunk_evicted_before_healing_keeps_no_kv(backend, one_thread):
    win = ContextWindow(backend, rank=2, patch_policy="latency")
    win.append(token_ids=seeded_ids(6, 1, vocab=60).tolist())
    a = win.append(token_ids=seeded_ids(7, 2, vocab=60).tolist())
    win.evict(a)
    entry = win._state.evicted[a]
    assert entry.unhealed and entry.owes_encode and entry.provisional is None
    assert entry.source["token_ids"].tolist() == seeded_ids(7, 2, vocab=60).tolist()
    rc = win.recall(a)
    # its first KV since it left, not a repair: one conditioned forward where it re-enters
    assert rc.forwards == 1 and rc.encodes == 0 and not rc.repairs and win.slot(a).provisional


def test_the_stored_prefix_hint_is_bounded(backend):
    ctx = ContextWindow(backend).context
    for c in range(PATCH_INDEX_CHUNKS + 10):
        ctx.note_stored_prefix(f"c{c}", ("p",))
    for p in range(PATCH_INDEX_PREFIXES + 5):
        ctx.note_stored_prefix("c-last", (f"p{p}",))
    index = ctx.patch_index
    assert index.contents() == PATCH_INDEX_CHUNKS and not index.may_hit("c10") and index.may_hit("c11")
    last = index.stored_prefixes("c-last")
    assert len(last) == PATCH_INDEX_PREFIXES and ("p0",) not in last and last[-1] == (f"p{PATCH_INDEX_PREFIXES + 4}",)
    assert index.g.number_of_edges() == len(index)  # the scheduler's edges shrink with what the bound forgets


@pytest.mark.parametrize("policy", ["default", "latency"])
def test_soak_memory_is_bounded_by_the_configuration(backend, tmp_path, one_thread, policy):
    """After warm-up nothing grows per operation past what the configuration allows: evicted refs
    at ``max_evicted``, the graph at the window plus those, and the bytes of live tensors (outside
    the model) at what was there before the first operation (root KV, tables) + the store's memory
    budget + the window's pages + the evicted refs' sources —
    where an unbounded history (every evicted ref, its graph edges, an unhealed chunk's page)
    would keep growing with the operations."""
    memory_budget, budget_tokens, section, cap, ops = 96 * 1024, 40, 8, 6, 300
    config = WindowConfig(budget_tokens=budget_tokens, max_evicted=cap, patch_policy=policy)
    r = run_soak(backend, ops=ops, config=config, section_tokens=section, memory_budget=memory_budget,
                 store_dir=str(tmp_path / "d"), sample_every=30, seed=5, warmup_ops=60, count_tensors=True)
    assert r["ops"] == ops and r["errors"] == {}, r["errors"]
    lay = backend.layout
    page = 4 * lay.num_layers * (lay.k_heads * lay.k_dim + lay.v_heads * lay.v_dim)  # fp32 K+V bytes per token
    # the window's slots: canonical + placed page + a full-size patch (+ a provisional copy) per token
    window = 4 * page * budget_tokens
    sources = cap * 2 * 8 * section  # token ids + positions (int64) of each remembered evicted ref
    bound = r["curve"][0]["tensor_bytes"] + memory_budget + window + sources  # + what was there before op 1
    after = [row for row in r["curve"] if row["op"] >= 60]
    assert len(after) >= 8
    for row in after:
        assert row["evicted_refs"] <= cap
        assert row["graph_nodes"] <= row["in_window"] + cap
        assert row["receipts"] <= 1000
        # anticipation's prepared re-forwards have their own caps (window/prepared.py): checked
        # against those, and the rest against the window's configuration
        assert row["prepared"] <= MAX_ENTRIES and row["prepared_bytes"] <= MAX_BYTES
        # ... whose chunks also hold their sources (token ids + positions, int64), as evicted refs do
        prepared_sources = 2 * 8 * (row["prepared_bytes"] // page)
        assert row["tensor_bytes"] - row["prepared_bytes"] <= bound + prepared_sources, (
            row["op"], row["tensor_bytes"], row["prepared_bytes"], bound, prepared_sources)
    # what an unbounded history would have held by now: every evicted ref
    assert sum(r["op_counts"].get(k, 0) for k in ("append",)) > 4 * cap
