"""The vLLM connector's cases, run inside a Python that has vLLM (``tests/test_vllm.py`` runs this
file in that interpreter, one engine per process, and checks the JSON it writes).

``python tests/vllm_cases.py writer|reader|multiprocess STORE_URL OUT.json``

- writer: first the load-time rotary check (vLLM's rotary for the model's own parameters passes,
  for another RoPE base it is refused); then a fresh engine with the connector (exact policy) on a shared store. Turn 1 reads four
  pages; turn 2 re-reads them in another order: served by the connector, and again by vLLM's own
  full prefill (prefix cache skipped) as the reference. Then turn 2 twice more: loaded layer-wise
  with the loading thread gated (the overlap, by the order of events), and with every layer
  loaded before the forward (``layerwise=False``).
- reader: a second engine (another process) on the same store: turn 2 again (every chunk was
  stored by the writer: 0 encodes), then bad entries — one page's stored copy corrupted, one
  replaced by another model's entry, one evicted — each in a prompt where it sits second: the
  connector serves only the page before it and vLLM prefills the rest; answers against vLLM's own
  prefill each time.
- multiprocess: a third engine with vLLM split over processes (scheduler and worker apart) on the
  same store serves a re-read (:func:`multiprocess`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any


def refusal() -> dict[str, Any]:
    """The load-time rotary check on the default model's layout: vLLM's rotary for its own
    ``rope_parameters`` passes; for another RoPE base (a model vLLM would rotate differently) it is
    refused with the reason."""
    import copy

    import contextdeque as cd
    from contextdeque.core.errors import UnsupportedLayoutError
    from contextdeque.integrations.vllm import check_vllm_rotary

    backend = cd.load_model()
    cfg = backend.model.config
    check_vllm_rotary(backend.layout, cfg, 2048)
    other = copy.deepcopy(cfg)
    other.rope_parameters = dict(other.rope_parameters, rope_theta=float(other.rope_parameters["rope_theta"]) * 4)
    out: dict[str, Any] = {"same": "passed"}
    try:
        check_vllm_rotary(backend.layout, other, 2048)
        out["other_theta"] = None
    except UnsupportedLayoutError as exc:
        out["other_theta"] = {"reason": exc.reason, "message": str(exc), "measured": exc.measured}
    return out


def multiprocess(store: str) -> dict[str, Any]:
    """vLLM split over processes (``VLLM_ENABLE_V1_MULTIPROCESSING=1``: the engine core with the
    scheduler in its own process; ``distributed_executor_backend="mp"``: the worker in another):
    the connector's scheduler side matches in one process, its metadata travels in vLLM's
    scheduler output, the worker side loads in another — both on the shared store. A re-read the
    earlier engines stored is served and answers as vLLM's own prefill."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    from contextdeque.integrations.paged import PromptCutter
    from contextdeque.integrations.vllm import runtimes
    from contextdeque.integrations.vllm_bench import conversation, make_engine, pages, prompt_ids, run_turn
    from contextdeque.model.default_model import ensure_default_model

    llm = make_engine(str(ensure_default_model(progress=False)), store=store, patch_policy="exact",
                      distributed_executor_backend="mp")
    tok = llm.get_tokenizer()
    ids = prompt_ids(tok, conversation((3, 1, 0, 2), 1, pages()))
    cut = PromptCutter(tok).cut(ids)
    llm.reset_prefix_cache()
    got = run_turn(llm, ids, max_tokens=8)
    ref = run_turn(llm, ids, mode="off", fresh_prefill=True, max_tokens=8)
    return {"got": dataclasses.asdict(got), "ref": dataclasses.asdict(ref), "frontend_runtimes": len(runtimes()),
            "prefix_lens": [cut.prefix_len(n) for n in range(len(cut.chunks) + 1)]}


def main(mode: str, store: str, out_path: str) -> None:
    if mode == "multiprocess":
        with open(out_path, "w") as f:
            json.dump({"multiprocess": multiprocess(store)}, f)
        return
    out: dict[str, Any] = {"refusal": refusal()} if mode == "writer" else {}
    from contextdeque.integrations.vllm import runtimes
    from contextdeque.integrations.vllm_bench import conversation, make_engine, pages, prompt_ids, run_turn
    from contextdeque.model.default_model import ensure_default_model

    llm = make_engine(str(ensure_default_model(progress=False)), store=store, patch_policy="exact")
    tok = llm.get_tokenizer()
    text = pages()
    rt = runtimes()[0]

    def pair(order: tuple[int, ...], question: int, layerwise: bool | None = None) -> dict[str, Any]:
        """The connector's answer and vLLM's own full prefill of the same prompt."""
        ids = prompt_ids(tok, conversation(order, question, text))
        before = dict(rt.stats)
        llm.reset_prefix_cache()
        got = run_turn(llm, ids, max_tokens=8, layerwise=layerwise)
        delta = {k: rt.stats[k] - before.get(k, 0.0) for k in rt.stats}
        ref = run_turn(llm, ids, mode="off", fresh_prefill=True, max_tokens=8)
        cut = rt.cutter.cut(ids)
        return {"got": dataclasses.asdict(got), "ref": dataclasses.asdict(ref), "stats": delta,
                "prefix_lens": [cut.prefix_len(n) for n in range(len(cut.chunks) + 1)]}

    if mode == "writer":
        first = prompt_ids(tok, conversation((0, 1, 2, 3), 0, text))
        run_turn(llm, first, max_tokens=1)
        out["turn1_stats"] = dict(rt.stats)
        out["reread"] = pair((2, 0, 3, 1), 2)
        # the same re-read again (its patches now come from the store), layer-wise with the loading
        # thread gated, then with every layer loaded before the forward
        out["overlap"] = overlap(rt, lambda: pair((2, 0, 3, 1), 2, layerwise=True))
        out["reread_serial"] = pair((2, 0, 3, 1), 2, layerwise=False)
    else:
        out["reread"] = pair((2, 0, 3, 1), 2)
        out["prefix_cache"] = prefix_cache(llm, tok, text)
        out["load_failure"] = load_failure(rt, pair)
        out["faults"] = faults(llm, rt, tok, text, pair)
    out["stats"] = dict(rt.stats)
    out["refused"] = rt.refused
    with open(out_path, "w") as f:
        json.dump(out, f)


def overlap(rt: Any, run: Any) -> dict[str, Any]:
    """``run()`` with the connector's loading thread held before the last layer until vLLM's
    forward has been given layer 0 (bounded: a load that does not overlap times out there): the
    pipeline's trace then shows vLLM waited for layer 0 before the last layer was loaded."""
    import threading

    from contextdeque.integrations.vllm import ContextDequeConnector as Connector

    last = rt.backend.layout.num_layers - 1
    given_0, opened, workers = threading.Event(), [], []
    real_wait = Connector.wait_for_layer_load

    def wait(self: Any, layer_name: str) -> None:
        real_wait(self, layer_name)
        workers.append(self)
        if self._layer_index(layer_name) == 0:
            given_0.set()

    def gate(layer: int) -> None:
        if layer == last:
            opened.append(given_0.wait(120.0))

    Connector.wait_for_layer_load, Connector.before_layer = wait, staticmethod(gate)
    try:
        got = run()
    finally:
        Connector.wait_for_layer_load, Connector.before_layer = real_wait, None
    pipe = workers[-1].last_pipeline
    return {"pair": got, "gate_opened": opened, "trace": pipe.trace if pipe is not None else [],
            "layers": last + 1, "background": pipe.background if pipe is not None else None}


def prefix_cache(llm: Any, tok: Any, text: list[str]) -> dict[str, Any]:
    """What vLLM's prefix cache finds after the connector served a prompt: the same prompt again
    with the connector off, after an approximate (latency-policy) load and after an exact one."""
    from contextdeque.integrations.vllm_bench import conversation, prompt_ids, run_turn

    ids = prompt_ids(tok, conversation((3, 2, 1, 0), 1, text))
    out = {}
    for policy in ("latency", "exact"):
        llm.reset_prefix_cache()
        served = run_turn(llm, ids, policy=policy, max_tokens=1)
        again = run_turn(llm, ids, mode="off", max_tokens=1)
        out[policy] = {"served_cached": served.cached_tokens, "again_cached": again.cached_tokens}
    llm.reset_prefix_cache()
    out["unknown_policy_cached"] = run_turn(llm, ids, policy="no-such-policy", max_tokens=1).cached_tokens
    return out


def load_failure(rt: Any, pair: Any) -> dict[str, Any]:
    """The worker side cannot build the matched KV (the store lost it between the match and the
    load): the connector reports the blocks and vLLM recomputes them."""
    from contextdeque.core.errors import StoreError

    real = rt.window_reader

    def lost(spec: Any) -> Any:
        rt.window_reader = real
        raise StoreError("injected: the store lost the entry between match and load")

    rt.window_reader = lost
    try:
        return pair((0, 2, 1, 3), 0)
    finally:
        rt.window_reader = real


def faults(llm: Any, rt: Any, tok: Any, text: list[str], pair: Any) -> dict[str, Any]:
    """Corrupt page 4's stored copy, put another model's entry under page 2's key, evict page 1:
    each then sits second in a prompt led by a healthy page."""
    import valkey

    from contextdeque.integrations.vllm_bench import conversation, prompt_ids
    from contextdeque.stores.base import StoreEntry
    from contextdeque.stores.traffic import TierTraffic

    ids = prompt_ids(tok, conversation((0, 1, 2, 3), 0, text))
    cut = rt.cutter.cut(ids)
    key = {page: rt.chunk_key(cut.root, cut.chunks[page]) for page in range(4)}
    remote = rt.store.tiers[-1]
    client = valkey.Valkey(host=remote.endpoint.host, port=remote.endpoint.port, db=remote.endpoint.db)

    def drop_local(k: str) -> None:
        for tier in rt.store.tiers[:-1]:
            tier.delete(k)

    out: dict[str, Any] = {}
    # corrupt: flip one byte of page 4's first part in Valkey (and forget the local copies)
    drop_local(key[3])
    part_key = remote.entry_info(key[3])["part_keys"][0]
    blob = bytearray(client.get(part_key))
    blob[len(blob) // 2] ^= 0x40
    client.set(part_key, bytes(blob))
    out["corrupt"] = pair((2, 3, 0, 1), 0)
    # another model: page 2's key now holds an entry another model wrote
    view = rt.view(cut.root)
    chunk = rt.window_store.get_chunk(key[1], fingerprint=view.fingerprint, layout=view.layout.signature,
                                      traffic=TierTraffic())
    tensors, meta = dataclasses.replace(chunk, fingerprint="0" * len(chunk.fingerprint)).to_entry()
    rt.store.delete(key[1])
    remote.put(key[1], StoreEntry(tensors, meta))
    out["other_model"] = pair((2, 1, 3, 0), 1)
    # evicted: page 1 is gone from every tier
    rt.store.delete(key[0])
    out["evicted"] = pair((2, 0, 1, 3), 2)
    return out

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
