"""Sessions: ``window.save(path)`` / ``ContextWindow.open(path, backend)``.

A saved window reopens with 0 forwards and materializes bit for bit as it was; it then goes on
exactly as the saved window would (slide, recall, reorder, generate give the same KV and
answers); the write is atomic; a wrong file, version or model is refused with ``SessionError``.
One test saves in a process that is then SIGKILLed and opens in a new process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import A, B, C, D, E, QUERY, micro_llama

from contextdeque.core.errors import SessionError
from contextdeque.model.hf import HFBackend
from contextdeque.window import ContextWindow
from contextdeque.window.session import SESSION_VERSION, read_manifest


def make_backend(seed: int = 0) -> HFBackend:
    return HFBackend(micro_llama(seed), None, root_ids=[1, 3], name="tiny-session-llama")


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    return make_backend(0)


def layers_of(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from contextdeque.core import compat

    return [compat.cache_layer(cache, i) for i in range(compat.cache_num_layers(cache))]


def assert_same_cache(a, b) -> None:
    la, lb = layers_of(a), layers_of(b)
    assert len(la) == len(lb)
    for (ka, va), (kb, vb) in zip(la, lb):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def busy_window(backend: HFBackend, **kw) -> ContextWindow:
    """A window with history: slides, an eviction, a recall (cascade), a reorder, a stale flag."""
    win = ContextWindow(backend, budget_tokens=20, rank=4, cascade_policy="flag", **kw)
    a = win.append(token_ids=A, label="a")
    b = win.append(token_ids=B, label="b")
    c = win.append(token_ids=C)
    win.evict(b)
    win.append(token_ids=D)
    win.recall(b, at=1)
    win.append(token_ids=E)  # budget 20: the oldest slide out
    win.reorder(list(reversed(win.refs)))
    assert win.evicted_refs, "the history must leave something evicted"
    del a, c
    return win


@pytest.mark.parametrize("policy", ["default", "latency", "exact"])
def test_reopen_is_forward_free_bit_identical_and_continues_the_same(backend, tmp_path, policy):
    win = busy_window(backend, patch_policy=policy)
    path = tmp_path / "s.cdq"
    receipt = win.save(path)
    assert receipt.op == "save" and receipt.forwards == 0 and path.is_file()
    before = win.materialize()

    fw0 = backend.forwards_run
    opened = ContextWindow.open(path, backend, store=None)
    assert backend.forwards_run == fw0, "opening runs no forward"
    assert opened.last_receipt.op == "open" and opened.last_receipt.forwards == 0
    assert_same_cache(opened.materialize(), before)
    assert backend.forwards_run == fw0

    # same shape of window: order, positions, evicted set, stale flags, pending heals, graph
    assert [(r.n_tokens, r.label) for r in opened.refs] == [(r.n_tokens, r.label) for r in win.refs]
    assert sorted(map(str, (r.label for r in opened.evicted_refs))) == sorted(map(str, (r.label for r in win.evicted_refs)))
    assert [(s, e) for _, s, e in opened.placement()] == [(s, e) for _, s, e in win.placement()]
    assert len(opened.evicted_refs) == len(win.evicted_refs)
    assert [win.refs.index(r) for r in win.stale_refs] == [opened.refs.index(r) for r in opened.stale_refs]
    assert [win.refs.index(r) for r in win.pending_refs] == [opened.refs.index(r) for r in opened.pending_refs]
    assert opened.graph.g.number_of_edges() == win.graph.g.number_of_edges()
    assert opened.generation == win.generation and opened.budget_tokens == win.budget_tokens
    assert not set(opened.refs) & set(win.refs), "reopened refs are fresh"
    assert opened.session.version == SESSION_VERSION

    # ... and both go on identically: same KV after each step, same answer
    def steps(w: ContextWindow) -> list:
        out = []
        w.slide(1)
        out.append(w.materialize())
        w.recall(w.evicted_refs[0], at=0)
        out.append(w.materialize())
        w.reorder(list(reversed(w.refs)))
        out.append(w.materialize())
        w.append(token_ids=A)
        out.append(w.materialize())
        out.append(w.generate(QUERY, max_new_tokens=4).token_ids)
        return out

    for x, y in zip(steps(win), steps(opened)):
        if isinstance(x, list):
            assert x == y
        else:
            assert_same_cache(x, y)


def test_reopened_versions_keep_patch_validity(backend, tmp_path):
    """Every slot whose conditioning was valid on its prefix is still valid after reopening
    (versions are recomputed under the fresh refs), and every stale one is still stale."""
    win = busy_window(backend)

    def validity(w: ContextWindow) -> list[bool]:
        slots = [w.slot(r) for r in w.refs]
        return [s.conditioned_on == tuple((p.ref, p.version) for p in slots[:i]) for i, s in enumerate(slots)]

    win.save(tmp_path / "v.cdq")
    opened = ContextWindow.open(tmp_path / "v.cdq", backend)
    assert validity(opened) == validity(win)
    assert len(opened.graph.stale_edges()) == len(win.graph.stale_edges())


def test_save_is_atomic(backend, tmp_path, monkeypatch):
    win = busy_window(backend)
    path = tmp_path / "a.cdq"
    win.save(path)
    saved = path.read_bytes()
    n_saved = [r.n_tokens for r in win.refs]
    win.append(token_ids=QUERY)

    def crash(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        win.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == saved, "a failed save leaves the previous session in place"
    assert [p.name for p in tmp_path.iterdir()] == ["a.cdq"], "no temp file left behind"
    assert [r.n_tokens for r in ContextWindow.open(path, backend).refs] == n_saved


def test_refusals(backend, tmp_path):
    win = busy_window(backend)
    path = tmp_path / "r.cdq"
    win.save(path)
    with pytest.raises(SessionError, match="no session"):
        ContextWindow.open(tmp_path / "missing.cdq", backend)
    other = make_backend(1)
    with pytest.raises(SessionError, match="model"):
        ContextWindow.open(path, other)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    bad = tmp_path / "bad.cdq"
    bad.write_bytes(bytes(data))
    with pytest.raises(SessionError, match="not a readable"):
        ContextWindow.open(bad, backend)
    # another schema version: rewrite the manifest with version 2 (checksums recomputed)
    from contextdeque.stores import StoreEntry
    from contextdeque.stores.format import encode_entry

    m, tensors = read_manifest(path)
    doc = json.loads(m.model_dump_json())
    doc["version"] = 2
    v2 = tmp_path / "v2.cdq"
    v2.write_bytes(encode_entry("contextdeque/session", StoreEntry(tensors, {"session": json.dumps(doc)}), 0))
    with pytest.raises(SessionError, match="version 2"):
        ContextWindow.open(v2, backend)


_SAVER = textwrap.dedent(
    """
    import os, signal, sys, hashlib, json
    sys.path.insert(0, {tests!r})
    import torch
    from helpers import A, B, C, D, E, QUERY, micro_llama
    from contextdeque.model.hf import HFBackend
    from contextdeque.window import ContextWindow
    torch.set_num_threads(1)
    backend = HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-session-llama")
    win = ContextWindow(backend, budget_tokens=20, rank=4)
    refs = [win.append(token_ids=ids) for ids in ({A!r}, {B!r}, {C!r})]
    win.evict(refs[1])
    win.append(token_ids={D!r})
    win.append(token_ids={E!r})
    win.save({path!r})
    cache = win.materialize()
    from contextdeque.core import compat
    h = hashlib.sha256()
    for i in range(compat.cache_num_layers(cache)):
        k, v = compat.cache_layer(cache, i)
        h.update(k.numpy().tobytes()); h.update(v.numpy().tobytes())
    print(json.dumps({{"digest": h.hexdigest(), "evicted": len(win.evicted_refs)}}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)

_OPENER = textwrap.dedent(
    """
    import sys, hashlib, json
    sys.path.insert(0, {tests!r})
    import torch
    from helpers import A, B, C, D, E, QUERY, micro_llama
    from contextdeque.model.hf import HFBackend
    from contextdeque.window import ContextWindow
    from contextdeque.core import compat
    torch.set_num_threads(1)
    backend = HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-session-llama")
    win = ContextWindow.open({path!r}, backend)
    cache = win.materialize()
    forwards = backend.forwards_run
    h = hashlib.sha256()
    for i in range(compat.cache_num_layers(cache)):
        k, v = compat.cache_layer(cache, i)
        h.update(k.numpy().tobytes()); h.update(v.numpy().tobytes())
    win.slide(1)
    win.recall(win.evicted_refs[0])
    answer = win.generate({Q!r}, max_new_tokens=3)
    print(json.dumps({{"digest": h.hexdigest(), "forwards": forwards, "evicted": len(win.evicted_refs),
                      "answer": answer.token_ids, "n": len(win.refs)}}), flush=True)
    """
)


def test_save_kill_open_in_a_new_process(tmp_path):
    tests = str(Path(__file__).parent)
    path = str(tmp_path / "killed.cdq")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    fmt = dict(tests=tests, path=path, A=A, B=B, C=C, D=D, E=E, Q=QUERY)
    saver = subprocess.run([sys.executable, "-c", _SAVER.format(**fmt)], capture_output=True, text=True, env=env, timeout=300)
    assert saver.returncode == -signal.SIGKILL, saver.stderr
    saved = json.loads(saver.stdout.strip().splitlines()[-1])
    opener = subprocess.run([sys.executable, "-c", _OPENER.format(**fmt)], capture_output=True, text=True, env=env, timeout=300)
    assert opener.returncode == 0, opener.stderr
    got = json.loads(opener.stdout.strip().splitlines()[-1])
    assert got["forwards"] == 0, "a new process opens and materializes with 0 forwards"
    assert got["digest"] == saved["digest"], "materialize() is bit-identical across processes"
    assert got["n"] >= 1 and len(got["answer"]) == 3


_SOURCE_OPENER = textwrap.dedent(
    """
    import sys, hashlib, json
    sys.path.insert(0, {tests!r})
    import torch
    from helpers import A, B, C, D, E, QUERY, micro_llama
    from contextdeque.model.hf import HFBackend
    from contextdeque.stores import MemoryTier, TieredStore
    from contextdeque.window import ContextWindow
    from contextdeque.core import compat
    torch.set_num_threads(1)
    backend = HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-session-llama")
    win = ContextWindow.open({path!r}, backend, store=TieredStore([MemoryTier("cpu", None)]))
    (gone,) = win.evicted_refs
    entry = win._state.evicted[gone]
    source = {{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in entry.source.items()}}
    dropped = win.store.store.delete(entry.chunk_key)  # as a budget would drop it after reopening
    receipt = win.recall(gone, at=1)
    cache = win.materialize()
    h = hashlib.sha256()
    for i in range(compat.cache_num_layers(cache)):
        k, v = compat.cache_layer(cache, i)
        h.update(k.numpy().tobytes()); h.update(v.numpy().tobytes())
    print(json.dumps({{"digest": h.hexdigest(), "source": source, "dropped": bool(dropped), "encodes": receipt.encodes,
                      "repairs": list(receipt.repairs), "labels": [r.label for r in win.refs]}}), flush=True)
    """
)


def test_evicted_sources_survive_a_session_in_a_new_process(backend, tmp_path, one_thread):
    """An evicted entry's source (the chunk's inputs) round-trips through save/open: in a new
    process whose store has lost the canonical, recall re-encodes it from the saved source and the
    window is bit-identical to the saved window's own recall."""
    from contextdeque.core import compat
    from contextdeque.stores import MemoryTier, TieredStore

    win = ContextWindow(backend, rank=4, store=TieredStore([MemoryTier("cpu", None)]), patch_policy="eager")
    win.append(token_ids=A, label="a")
    b = win.append(token_ids=B, label="b")
    win.append(token_ids=C, label="c")
    win.evict(b)
    saved_source = win._state.evicted[b].source
    path = str(tmp_path / "src.cdq")
    win.save(path)
    win.recall(b, at=1)
    cache = win.materialize()
    import hashlib

    h = hashlib.sha256()
    for i in range(compat.cache_num_layers(cache)):
        k, v = compat.cache_layer(cache, i)
        h.update(k.numpy().tobytes()), h.update(v.numpy().tobytes())

    # one thread here and there (``one_thread``): bit-identity across processes needs the same
    # reduction order, which the thread count decides
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code = _SOURCE_OPENER.format(tests=str(Path(__file__).parent), path=path)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["source"]["token_ids"] == saved_source["token_ids"].tolist() == B
    assert got["source"]["rel_positions"] == saved_source["rel_positions"].tolist()
    assert (got["source"]["span"], got["source"]["modality"]) == (saved_source["span"], saved_source["modality"])
    assert got["dropped"] and got["encodes"] == 1, got
    assert any("re-encoded" in r and "from its source" in r for r in got["repairs"]), got["repairs"]
    assert got["labels"] == ["a", "b", "c"]
    assert got["digest"] == h.hexdigest(), "the recall after reopening is the recall before saving"


def test_max_evicted_survives_a_session(backend, tmp_path):
    """The evicted-ref cap is configuration: a reopened window keeps forgetting at the same cap."""
    win = busy_window(backend, max_evicted=1)
    assert len(win.evicted_refs) == 1
    win.save(tmp_path / "cap.cdq")
    assert read_manifest(tmp_path / "cap.cdq")[0].config.max_evicted == 1
    opened = ContextWindow.open(tmp_path / "cap.cdq", backend)
    opened.evict(opened.refs[-1])
    opened.evict(opened.refs[-1])
    assert len(opened.evicted_refs) == 1


def test_anticipate_survives_a_session(backend, tmp_path):
    """Anticipation is configuration: a reopened window prepares re-reads as the saved one did."""
    win = busy_window(backend, anticipate=True)
    win.save(tmp_path / "ant.cdq")
    assert read_manifest(tmp_path / "ant.cdq")[0].config.anticipate is True
    assert ContextWindow.open(tmp_path / "ant.cdq", backend)._ctx.config.anticipate is True
