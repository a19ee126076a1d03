"""The layer-wise load a serving engine's connector runs (``contextdeque.integrations.layerwise``),
without the engine: the engine's wait for layer ``l`` returns once layer ``l`` is loaded, before
later layers are (the overlap, shown by the order of events, not by timing); a window's KV written
layer by layer into a paged cache is the KV written whole; failures drop only their task."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import micro_llama

from contextdeque.core.errors import ArgumentError, StoreError
from contextdeque.integrations.layerwise import LayerPipeline
from contextdeque.integrations.paged import CpuPagedLayout
from contextdeque.model.hf import HFBackend
from contextdeque.window import ContextWindow

#: how long the gated loading thread waits for the engine before giving up (liveness only: the
#: assertions are on the order of events; a pipeline without overlap reaches this bound)
GATE_S = 60.0


def _gated(n_layers: int, background: bool) -> tuple[LayerPipeline[str], list[bool]]:
    """A pipeline whose loading thread, before the last layer, waits for the engine to have been
    given layer 0: only possible if layer 0's wait returns while later layers are unloaded."""
    given_0 = threading.Event()
    gate_opened: list[bool] = []

    def before_layer(layer: int) -> None:
        if layer == n_layers - 1:
            gate_opened.append(given_0.wait(GATE_S if background else 0.0))

    pipe = LayerPipeline(n_layers, [("req", lambda: (lambda layer: None))], background=background,
                         before_layer=before_layer)
    pipe.start()
    pipe.wait(0)
    given_0.set()
    for layer in range(1, n_layers):
        pipe.wait(layer)
    assert pipe.join() == {}
    return pipe, gate_opened


def test_wait_for_layer_0_returns_before_the_last_layer_is_loaded():
    pipe, gate_opened = _gated(6, background=True)
    assert gate_opened == [True]
    assert pipe.trace.index(("waited", 0)) < pipe.trace.index(("loaded", 5))
    # every wait came after its own layer's load, in layer order
    for layer in range(6):
        assert pipe.trace.index(("loaded", layer)) < pipe.trace.index(("waited", layer))
    assert [e for e in pipe.trace if e[0] == "loaded"] == [("loaded", layer) for layer in range(6)]


def test_inline_loading_finishes_every_layer_before_the_first_wait():
    """``background=False`` (the baseline): the same order check fails, as it must."""
    pipe, gate_opened = _gated(6, background=False)
    assert gate_opened == [False]
    assert pipe.trace.index(("loaded", 5)) < pipe.trace.index(("waited", 0))


@pytest.mark.parametrize("policy", ["exact", "latency"])
@pytest.mark.parametrize("background", [True, False])
def test_a_window_loaded_layer_by_layer_writes_the_kv_written_whole(policy, background):
    """Two requests' windows, relocated and patched per layer on the loading thread and written
    into a paged cache (vLLM's CPU layout), equal the windows' ``kv_layers()`` written whole."""
    backend = HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-layerwise-llama")
    L, H, d, B = backend.layout.num_layers, backend.layout.k_heads, backend.layout.k_dim, 4
    paged = CpuPagedLayout(B, H, d)
    requests = {"a": ([[5, 6, 7, 8], [9, 10, 11]], [7, 2, 5, 0], 2), "b": ([[12, 13, 14], [20, 21, 22, 23, 24]], [1, 3, 6, 4], 4)}
    got = [torch.zeros(8, H, B, 2 * d) for _ in range(L)]
    want = [torch.zeros(8, H, B, 2 * d) for _ in range(L)]

    def window(chunks: list[list[int]]) -> ContextWindow:
        win = ContextWindow(backend, patch_policy=policy, rank=2)
        refs = [win.append(token_ids=c) for c in chunks]
        win.reorder(list(reversed(refs)))
        return win

    def task(chunks: list[list[int]], table: list[int], start: int):
        def prepare():
            read = window(chunks).kv_layer_reader()

            def load(layer: int) -> None:
                k, v = read(layer)
                paged.write(got[layer], table, start, k[:, start:], v[:, start:])

            return load

        return prepare

    for chunks, table, start in requests.values():
        for layer, (k, v) in enumerate(window(chunks).kv_layers()):
            paged.write(want[layer], table, start, k[:, start:], v[:, start:])
    pipe = LayerPipeline(L, [(key, task(*r)) for key, r in requests.items()], background=background).start()
    for layer in range(L):
        pipe.wait(layer)
        assert torch.equal(got[layer], want[layer]), layer  # this layer is complete when its wait returns
    assert pipe.join() == {}
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_failure_drops_only_its_task_from_that_layer_on():
    loaded: dict[str, list[int]] = {"ok": [], "bad_layer": [], "bad_prepare": []}

    def task(key: str):
        def prepare():
            if key == "bad_prepare":
                raise StoreError("injected: the canonical is gone")

            def load(layer: int) -> None:
                if key == "bad_layer" and layer == 2:
                    raise StoreError("injected: layer 2 cannot be written")
                loaded[key].append(layer)

            return load

        return prepare

    pipe = LayerPipeline(4, [(k, task(k)) for k in loaded]).start()
    for layer in range(4):
        pipe.wait(layer)
    failed = pipe.join()
    assert set(failed) == {"bad_layer", "bad_prepare"} and all(isinstance(e, StoreError) for e in failed.values())
    assert loaded == {"ok": [0, 1, 2, 3], "bad_layer": [0, 1], "bad_prepare": []}


def test_other_errors_reach_the_waiting_engine_and_no_wait_hangs():
    def prepare():
        def load(layer: int) -> None:
            if layer == 1:
                raise RuntimeError("a bug, not a store fault")

        return load

    pipe = LayerPipeline(3, [("req", prepare)]).start()
    with pytest.raises(RuntimeError, match="a bug"):
        for layer in range(3):
            pipe.wait(layer)
    with pytest.raises(RuntimeError, match="a bug"):
        pipe.join()


def test_bad_arguments_are_typed():
    with pytest.raises(ArgumentError, match="n_layers"):
        LayerPipeline(0, [])
    pipe = LayerPipeline(2, []).start()
    with pytest.raises(ArgumentError, match="outside the 2 layers"):
        pipe.wait(2)
    pipe.join()
