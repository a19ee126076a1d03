"""Random operation sequences against a reference that re-prefills the window from scratch.

A Hypothesis ``RuleBasedStateMachine`` drives append / slide / reorder / evict / recall / purge /
fork / commit / discard (and operations that must fail) on a ContextWindow and checks after
every step:

- exact policy: the materialized KV equals one forward over root + chunks (to float rounding);
- latency-first policies (``latency`` over the eager policy, ``latency:exact``): slide, evict,
  recall and reorder run no forward; ``heal`` with random step budgets is interleaved, and a
  fully healed ``latency:exact`` window equals the re-prefill too;
- eager and none policies: every survivor of a slide or eviction holds exactly the content
  KV it held before, re-placed (relocation only), except that the eager policy's survivor at
  the front holds its canonical (exact there);
- any policy: positions are contiguous from the root on, the budget is never exceeded,
  evicted chunks stay recallable (and are, on recall, from their canonical with a fresh patch),
  a fork never changes its parent, a failed operation changes nothing, and no chunk already
  in the store is encoded again (encodes == distinct contents ever appended).

1,000 sequences on a really tiny random llama (2 layers, hidden 32, chunks of 3-12 tokens),
derandomized so CI is reproducible; plus a short run on the real default model.
"""

from __future__ import annotations

import os
import random
from contextlib import contextmanager

import hypothesis.strategies as st
import pytest
import torch
from helpers import micro_llama
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from contextdeque.core import compat
from contextdeque.model.hf import HFBackend
from contextdeque.core.errors import BudgetError, UnknownRefError, WindowError
from contextdeque.core.operator import to_content_frame
from contextdeque.window import CASCADE_POLICIES, ChunkRef, ContextWindow, WindowStore

# 1,000 sequences in CI; CDQ_SM_EXAMPLES lowers it for a quick local run.
TINY_EXAMPLES = int(os.environ.get("CDQ_SM_EXAMPLES", "1000"))


def tiny_backend() -> HFBackend:
    return HFBackend(micro_llama(7), None, root_ids=[1, 3], name="tiny-sm-llama")


def tiny_pool() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 64) for _ in range(n)] for n in (3, 5, 7, 12, 4, 9, 6, 10)]


@contextmanager
def torch_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def window_ids(win: ContextWindow) -> list[int]:
    ids = list(win.root_ids)
    for r in win.refs:
        ids += win.chunk(r).token_ids.tolist()
    return ids


def make_machine(backend: HFBackend, pool: list[list[int]], policies: list[str], budgets: tuple[int, int]):
    """A state machine class over ``backend`` appending chunks from ``pool``."""
    lay = backend.layout

    class WindowMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.root: ContextWindow | None = None
            self.win: ContextWindow | None = None
            self.known: dict[int, set] = {}  # id(window) -> refs ever placed in its lineage
            self.purged: dict[int, set] = {}
            self.contents: set[str] = set()  # chunk ids ever appended
            self.parent_before = None

        # ------------------------------------------------------------------ helpers
        def snap(self, win: ContextWindow):
            cache = win.materialize()
            kv = [tuple(t.clone() for t in compat.cache_layer(cache, l)) for l in range(compat.cache_num_layers(cache))]
            return (win.refs, win.evicted_refs, tuple(win.placement()), win.generation, win.stale_refs), kv

        def same(self, a, b) -> bool:
            return a[0] == b[0] and all(
                torch.equal(k1, k2) and torch.equal(v1, v2) for (k1, v1), (k2, v2) in zip(a[1], b[1])
            )

        def survivors_before(self):
            """Content-frame KV and patches of every slot, to check keep-as-is survivors."""
            out = {}
            for r in self.win.refs:
                s = self.win.slot(r)
                out[r] = (s.patches, to_content_frame(list(s.page), lay, s.positions()))
            return out

        def check_survivors(self, before, left) -> None:
            if self.exact_regime():  # survivors get removal patches, or the canonical at the front
                return  # exact survivors get removal patches (checked against the reference)
            for i, r in enumerate(self.win.refs):
                if r not in before:
                    continue
                s = self.win.slot(r)
                patches, (k0, v0) = before[r]
                k1, v1 = to_content_frame(list(s.page), lay, s.positions())
                if i == 0 and self.policy != "none" and not s.provisional:
                    # at the front the canonical is exact: a survivor there drops its patches
                    c = self.win.chunk(r)
                    assert s.patches == (), "a survivor at the front kept patches for departed antecedents"
                    assert torch.allclose(k1, c.keys.float(), atol=1e-5, rtol=1e-5)
                    assert torch.allclose(v1, c.values.float(), atol=1e-5, rtol=1e-5)
                    continue
                assert s.patches == patches, "a survivor's conditioning changed"
                assert torch.allclose(k1, k0, atol=1e-5, rtol=1e-5) and torch.allclose(v1, v0, atol=1e-5, rtol=1e-5)
            assert not (set(left) & set(self.win.refs))

        def placed(self, refs) -> None:
            self.known[id(self.win)].update(refs)

        def forked(self) -> bool:
            return self.win is not None and self.win is not self.root

        def latency(self) -> bool:
            return self.policy.startswith("latency")

        def exact_regime(self) -> bool:
            return self.policy in ("exact", "latency:exact")

        # ------------------------------------------------------------------ setup
        @initialize(
            policy=st.sampled_from(policies),
            cascade=st.sampled_from(CASCADE_POLICIES),
            budget=st.integers(*budgets),
            rank=st.sampled_from([1, 2, 4]),
            initial=st.lists(st.integers(0, len(pool) - 1), min_size=1, max_size=4),
            anticipate=st.booleans(),
        )
        def start(self, policy, cascade, budget, rank, initial, anticipate) -> None:
            self.policy = policy
            self.budget = budget
            self.anticipate = anticipate
            self.root = self.win = ContextWindow(
                backend, budget_tokens=budget, rank=rank, patch_policy=policy, cascade_policy=cascade,
                anticipate=anticipate,
            )
            self.known[id(self.win)] = set()
            self.purged[id(self.win)] = set()
            for i in initial:  # start from a populated window: the interesting cases need one
                self.append(i)

        # ------------------------------------------------------------------ operations
        @rule(i=st.integers(0, len(pool) - 1))
        def append(self, i) -> None:
            before = self.survivors_before()
            cid = backend.chunk_id_for(token_ids=pool[i])
            stored = self.win.store.has(WindowStore.chunk_key(cid, backend.fingerprint))
            ref = self.win.append(token_ids=pool[i])
            seen = ref.chunk_id in self.contents
            if self.latency():  # content the store lacks: one forward, conditioned (or canonical at the front)
                assert ref.receipt.forwards == (0 if stored else 1) and ref.receipt.encodes <= (0 if stored else 1)
            else:
                assert ref.receipt.encodes == (0 if seen else 1)
            self.contents.add(ref.chunk_id)
            assert self.win.refs[-1] == ref
            self.placed([ref])
            self.check_survivors(before, ref.receipt.left)

        @rule(data=st.data())
        def slide(self, data) -> None:
            n = data.draw(st.integers(0, len(self.win)), label="n")
            old = self.win.refs
            before = self.survivors_before()
            rc = self.win.slide(n)
            assert rc.left == old[:n] and self.win.refs == old[n:]
            assert rc.encodes == 0
            if self.policy != "exact":
                assert rc.forwards == 0
            self.check_survivors(before, rc.left)

        @precondition(lambda self: self.win is not None and len(self.win) > 0)
        @rule(data=st.data())
        def evict(self, data) -> None:
            ref = data.draw(st.sampled_from(self.win.refs), label="ref")
            before = self.survivors_before()
            rc = self.win.evict(ref)
            assert ref in self.win.evicted_refs and ref not in self.win
            assert rc.encodes == 0
            if self.latency():
                assert rc.forwards == 0
            self.check_survivors(before, rc.left)

        @precondition(lambda self: self.win is not None and len(self.win.evicted_refs) > 0)
        @rule(data=st.data())
        def recall(self, data) -> None:
            ref = data.draw(st.sampled_from(self.win.evicted_refs), label="ref")
            at = data.draw(st.none() | st.integers(0, len(self.win)), label="at")
            stale = {k for k in self.win._state.evicted[ref].stale_patch_keys}
            unhealed = self.win._state.evicted[ref].owes_encode
            carried = {r: self.win.slot(r).patches for r in self.win.refs}
            rc = self.win.recall(ref, at=at)
            # a chunk that left before its canonical was computed (latency-first) owes that one encode
            assert rc.encodes <= (1 if unhealed else 0), "recall re-encoded a stored chunk"
            assert ref in self.win and ref not in self.win.evicted_refs
            self.placed([ref])
            slot = self.win.slot(ref)
            idx = self.win.refs.index(ref)
            prefix_ids = tuple(self.win.chunk(r).id for r in self.win.refs[:idx])
            if self.latency():
                # no forward but the one a chunk that left with no canonical owes: its canonical
                # (at the front, or latency-shared), else one conditioned forward where it re-enters
                assert rc.forwards == rc.encodes or (unhealed and rc.forwards == 1 and slot.provisional)
                deferred = {r for r, _, _ in rc.deferred}
                assert deferred <= set(self.win.pending_refs)
                if prefix_ids and ref not in deferred and not slot.provisional:  # served by a stored, still valid patch
                    assert slot.patches and slot.patches[-1].antecedents in (prefix_ids, tuple(sorted(prefix_ids)))
            elif self.policy != "none" and prefix_ids:
                # recall and exact patches share one store key (same measurement): a recall may be
                # served by the exact patch an earlier append formed on this very prefix
                assert [p.kind for p in slot.patches] in (["recall"], ["exact"])
                assert slot.patches[0].antecedents == prefix_ids  # fresh: on what precedes it now
            else:
                assert slot.patches == ()
            for c in slot.stack:  # a patch it carried when evicted only if formed on this very context
                assert c.key not in stale or c.patch.antecedents == prefix_ids, "recall replayed a stale patch"
            cas = rc.cascade
            assert cas is not None and cas.recalled == ref and set(cas.direct) <= set(cas.implied)
            assert set(cas.implied) <= set(self.win.refs) - {ref}
            if cas.action == "reform" and self.latency():  # reforms are deferred to heal
                assert set(cas.implied) - set(cas.reformed) <= set(self.win.pending_refs)
            elif cas.action == "reform":
                # each implied dependent is re-formed, or (a recall placed where stored patches stay
                # valid) already carries a patch formed on exactly what precedes it now, or is one
                # the recall was inserted before: carried out as its own decision says (its stored
                # patch on the new prefix, else it keeps what it carried, as a survivor does:
                # ``Decision.may_keep``)
                for dep in set(cas.implied) - set(cas.reformed):
                    d_idx = self.win.refs.index(dep)
                    d_prefix = tuple(self.win.chunk(r).id for r in self.win.refs[:d_idx])
                    d_patches = self.win.slot(dep).patches
                    if d_idx > idx and d_patches == carried[dep]:
                        continue
                    assert d_patches and d_patches[-1].antecedents in (d_prefix, tuple(sorted(d_prefix))), dep
            elif cas.action == "flag":
                assert set(cas.flagged) | set(cas.reformed) == set(cas.implied)
                assert set(cas.flagged) <= set(self.win.stale_refs)
            else:
                assert not cas.flagged

        @precondition(lambda self: self.win is not None and len(self.win) > 1)
        @rule(data=st.data())
        def evict_then_recall(self, data) -> None:
            """Evict a chunk others were conditioned on, then bring it back: the cascade path."""
            ref = data.draw(st.sampled_from(self.win.refs[:-1]), label="ref")
            self.win.evict(ref)
            at = data.draw(st.none() | st.integers(0, len(self.win)), label="at")
            before = self.win.cascade_preview(ref)
            rc = self.win.recall(ref, at=at)
            assert set(rc.cascade.implied) <= set(before)  # the graph predicted it

        @precondition(lambda self: self.win is not None and len(self.win) > 1)
        @rule(data=st.data())
        def reorder(self, data) -> None:
            order = data.draw(st.permutations(list(self.win.refs)), label="order")
            rc = self.win.reorder(order)
            assert self.win.refs == tuple(order) and rc.encodes == 0
            if self.latency():
                assert rc.forwards == 0

        @precondition(lambda self: self.win is not None)
        @rule(steps=st.none() | st.integers(0, 3))
        def heal(self, steps) -> None:
            pending = set(self.win.pending_refs)
            rc = self.win.heal(max_steps=steps)
            if not self.anticipate:  # heal does the queued work only
                assert set(rc.refs) <= pending | set(self.win.evicted_refs)
                assert rc.encodes == 0 or self.latency()  # latency-first: canonicals of new content
                if not self.latency():
                    assert rc.forwards == 0 and not pending
            else:  # and prepares re-reads of what it holds and held (idle forwards only)
                assert set(rc.refs) <= pending | set(self.win.evicted_refs) | set(self.win.refs)
                if not self.latency():
                    assert not pending
            if steps is None:
                assert not self.win.pending_refs

        @precondition(lambda self: self.win is not None and len(self.win.evicted_refs) > 0)
        @rule(data=st.data())
        def purge(self, data) -> None:
            ref = data.draw(st.sampled_from(self.win.evicted_refs), label="ref")
            self.win.purge(ref)
            self.purged[id(self.win)].add(ref)
            with pytest.raises(UnknownRefError):
                self.win.recall(ref)

        @precondition(lambda self: self.win is not None)
        @rule(data=st.data())
        def failing_operations(self, data) -> None:
            """Operations that must raise a typed error and change nothing."""
            before = self.snap(self.win)
            kind = data.draw(st.sampled_from(["reorder", "oversize", "slide", "recall_in_window"]), label="kind")
            if kind == "reorder":
                with pytest.raises(WindowError):
                    self.win.reorder(list(self.win.refs)[1:] + [ChunkRef(key=-1, chunk_id="?", n_tokens=1)])
            elif kind == "oversize":
                with pytest.raises(BudgetError):
                    self.win.append(token_ids=[5] * (self.budget + 1))
            elif kind == "slide":
                with pytest.raises(WindowError):
                    self.win.slide(len(self.win) + 1)
            elif len(self.win):
                with pytest.raises(WindowError):
                    self.win.recall(self.win.refs[0])
            assert self.same(before, self.snap(self.win))

        # ------------------------------------------------------------------ forks
        @precondition(lambda self: self.win is not None and self.win is self.root and len(self.win) > 0)
        @rule()
        def fork(self) -> None:
            self.parent_before = self.snap(self.root)
            child = self.root.fork()
            assert self.root.last_receipt.total_bytes_moved == 0
            self.known[id(child)] = set(self.known[id(self.root)])
            self.purged[id(child)] = set(self.purged[id(self.root)])
            self.win = child

        @precondition(lambda self: self.forked() and self.win.generation > self.root.generation)
        @rule()
        def commit(self) -> None:
            child = self.win
            child.commit()
            self.known[id(self.root)] = self.known.pop(id(child))
            self.purged[id(self.root)] = self.purged.pop(id(child))
            self.win, self.parent_before = self.root, None

        @precondition(lambda self: self.forked() and self.win.generation > self.root.generation)
        @rule()
        def discard(self) -> None:
            child = self.win
            child.discard()
            self.known.pop(id(child)), self.purged.pop(id(child))
            self.win = self.root
            assert self.same(self.parent_before, self.snap(self.root))
            self.parent_before = None

        @precondition(lambda self: self.forked() and self.win.generation > self.root.generation)
        @rule()
        def parent_moves_then_commit_is_refused(self) -> None:
            child = self.win
            self.win = self.root
            self.root.slide(min(1, len(self.root)))
            with pytest.raises(WindowError):
                child.commit()
            child.discard()
            self.known.pop(id(child)), self.purged.pop(id(child))
            self.parent_before = None

        # ------------------------------------------------------------------ invariants
        @invariant()
        def contiguous_and_within_budget(self) -> None:
            if self.win is None:
                return
            for w in {id(self.win): self.win, id(self.root): self.root}.values():
                pos = backend.root_len
                for ref, start, end in w.placement():
                    assert start == pos, "positions are not contiguous"
                    assert end == start + w.chunk(ref).span
                    pos = end
                assert w.tokens_used <= self.budget
                assert w.next_position() == pos

        @invariant()
        def evicted_stay_recallable(self) -> None:
            if self.win is None:
                return
            w = self.win
            expected = self.known[id(w)] - set(w.refs) - self.purged[id(w)]
            assert set(w.evicted_refs) == expected
            for ref in w.evicted_refs:
                if not w._state.evicted[ref].owes_encode:  # else: canonicalized on recall or heal
                    assert w.store.has(WindowStore.chunk_key(ref.chunk_id, backend.fingerprint))

        @invariant()
        def never_reencodes(self) -> None:
            if self.win is None:
                return
            if self.latency():  # canonicals of new content are computed when healing (once)
                assert self.win.context.counters.encodes <= len(self.contents)
            else:
                assert self.win.context.counters.encodes == len(self.contents)

        @invariant()
        def exact_equals_reprefill(self) -> None:
            if self.win is None or not self.exact_regime() or self.win.pending_refs:
                return
            ids = window_ids(self.win)
            ref = backend.forward(input_ids=ids, positions=backend.text_positions(0, len(ids)), logits="none").kv
            cache = self.win.materialize()
            for l, (k, v) in enumerate(ref):
                ck, cv = compat.cache_layer(cache, l)
                tol = 1e-5 * max(1.0, float(k.abs().max()), float(v.abs().max()))
                assert float((ck[0] - k).abs().max()) < tol and float((cv[0] - v).abs().max()) < tol

        @invariant()
        def fork_never_changes_parent(self) -> None:
            if self.parent_before is not None:
                assert self.same(self.parent_before, self.snap(self.root))

        @invariant()
        def graph_matches_slots(self) -> None:
            if self.win is None:
                return
            g = self.win.graph
            for r in self.win.refs:
                slot = self.win.slot(r)
                assert g.in_window(r)
                expected = {a for a, _ in slot.conditioned_on if a in g.g}
                assert set(g.antecedents(r)) == expected

    return WindowMachine


def test_window_state_machine_tiny_model():
    backend = tiny_backend()
    machine = make_machine(backend, tiny_pool(), ["exact", "eager", "none", "latency", "latency:exact", "latency-shared"], (12, 48))
    with torch_threads(1):  # tiny matrices: a second thread only adds synchronisation
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=TINY_EXAMPLES,
                stateful_step_count=10,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
            ),
        )


@pytest.mark.slow
def test_window_state_machine_default_model(default_backend):
    from pydoc_data.topics import topics

    tok = default_backend.tokenizer
    pool = []
    for name in ("assert", "pass", "break", "continue", "del"):
        ids = tok(topics[name], add_special_tokens=False)["input_ids"]
        pool.append(ids[: 6 + 2 * len(pool)])  # 6..14 tokens of real documentation text
    machine = make_machine(default_backend, pool, ["exact", "eager"], (20, 40))
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=3,
            stateful_step_count=5,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
        ),
    )
