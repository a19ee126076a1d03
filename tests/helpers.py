"""Plain helpers shared by test modules (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import torch


def seeded_ids(n: int, seed: int, vocab: int = 250) -> torch.Tensor:
    """``[n]`` deterministic token ids in ``[4, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g)


def micro_llama(seed: int = 0):
    """A 2-layer, hidden-32 random llama (far from uniform attention, so conditioning is clearly
    non-zero): small enough for thousands of window operations in CI."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model.eval()


def replay_agent_trace(path, capsys) -> dict:
    """Replay a trace an agent recorded through ``contextdeque replay --json`` (every registered
    placement x the patch / prefix-cache / re-prefill arms); returns the parsed output after
    checking every combination replayed every query of the trace."""
    import json

    from contextdeque.cli import main
    from contextdeque.traces import read_trace

    trace = read_trace(path)
    queries = sum(1 for e in trace.events if e.op == "query")
    capsys.readouterr()
    assert main(["replay", str(path), "--json", "--jobs", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["results"] and all(r["queries"] == queries and r["events"] == len(trace.events) for r in out["results"])
    return out


# token ids of five small chunks and a query (the window and session tests build windows of them)
A = [5, 6, 7, 8]
B = [9, 10, 11]
C = [12, 13, 14, 15, 16, 17]
D = [20, 21, 22, 23, 24]
E = [30, 31, 32, 33, 34, 35, 36]
QUERY = [40, 41, 42]


def spy_expect(monkeypatch) -> list:
    """Record every ``ContextWindow.expect(ref, at)`` call (the window still gets it)."""
    from contextdeque.window import ContextWindow

    calls: list = []
    real = ContextWindow.expect

    def expect(self, ref, at=None):
        calls.append((ref, at))
        return real(self, ref, at)

    monkeypatch.setattr(ContextWindow, "expect", expect)
    return calls


def assert_rereads_anticipated(steps, op: str) -> list:
    """Every recall in the ``op`` steps ran no forward on the critical path and served each chunk
    it conditioned from what idle time prepared (``Receipt.served``: anticipated or stored),
    deferring nothing; returns those recall receipts (at least one)."""
    from contextdeque.window.receipt import PREPARED_SERVED

    recalls = [r for s in steps if s.op == op for r in s.receipts if r.op == "recall"]
    assert recalls
    for r in recalls:
        assert r.forwards == 0 and r.encodes == 0 and not r.deferred, r
        assert {what for _, what in r.served} <= set(PREPARED_SERVED), r.served
    assert any(what == "anticipated" for r in recalls for _, what in r.served)
    return recalls


def window_answer_logits(backend, win, query) -> torch.Tensor:
    """The first answer token's logits for ``query`` (token ids) from the window's own KV."""
    from contextdeque.core import compat

    cache = win.materialize()
    past = [tuple(t[0] for t in compat.cache_layer(cache, l)) for l in range(compat.cache_num_layers(cache))]
    start = win.next_position()
    return backend.forward(input_ids=query, positions=backend.text_positions(start, len(query)), past=past).logits[-1]


# pages of different lengths and a query (the anticipation tests: a budget of 22 tokens holds four)
POOL = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15], [20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36], [40, 41, 42],
        [44, 45, 46, 47]]
POOL_QUERY = [50, 51, 52]


def micro_llama_backend_fixture(seed: int, name: str):
    """A module-scoped pytest fixture (assign it to ``backend`` in a test module) of a
    :func:`micro_llama` backend with root ``[1, 3]``, run on one thread."""
    import pytest

    @pytest.fixture(scope="module")
    def backend(one_thread):
        from contextdeque.model.hf import HFBackend

        return HFBackend(micro_llama(seed), None, root_ids=[1, 3], name=name)

    return backend


def pool_answer_logits(backend, win) -> torch.Tensor:
    """:func:`window_answer_logits` of :data:`POOL_QUERY`."""
    return window_answer_logits(backend, win, POOL_QUERY)


def build_pool_window(backend, policy, *, anticipate=False, provisional=False, budget=22):
    """The first five :data:`POOL` pages through a budget of four (the first slides out), healed
    after each append; returns ``(window, refs)``. Known content (canonicals exist) unless
    ``provisional`` (new content: latency-first appends it with one conditioned forward and no
    canonical); ``anticipate=None``: the window's default."""
    from contextdeque.window import ContextWindow

    settings = {} if anticipate is None else {"anticipate": anticipate}
    win = ContextWindow(backend, budget_tokens=budget, rank=2, patch_policy=policy, **settings)
    refs = []
    for p in POOL[:5]:
        refs.append(win.append(token_ids=p) if provisional else win.append(chunk=backend.encode(token_ids=p)))
        win.heal()
    return win, refs


def assert_relocates_as_dense(backend, chunk, patch, start: int = 50) -> None:
    """relocate() of ``chunk`` with ``patch`` equals the oracle: the content plus each layer's
    dense fp32 Δ (``patch.layer_delta``), relocated without a patch."""
    import dataclasses

    from contextdeque.core.operator import relocate

    got = relocate(chunk, start, layout=backend.layout, patch=patch)
    dense = dataclasses.replace(chunk, keys=chunk.keys.clone(), values=chunk.values.clone())
    for layer in range(chunk.num_layers):
        dk, dv = patch.layer_delta(layer)
        if dk is not None:
            dense.keys[layer] += dk.to(dense.keys.dtype)
            dense.values[layer] += dv.to(dense.values.dtype)
    want = relocate(dense, start, layout=backend.layout)
    for (k, v), (k2, v2) in zip(got, want):
        torch.testing.assert_close(k, k2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v2, rtol=1e-5, atol=1e-5)
