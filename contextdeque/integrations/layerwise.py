"""Layer-wise loading: an engine's forward reads layer ``l``'s KV only when it reaches layer
``l``'s attention, so a connector that loads layer by layer on another thread lets the engine
compute layer ``l`` while layer ``l + 1`` is still being loaded. No engine is imported here.

A :class:`LayerPipeline` runs one forward step's loads: each task first *prepares* (whole-model
work that cannot be split per layer: for a window, fetching its canonicals and patches and any
conditioned forward its policy asks for), then loads layers ``0, 1, ..., L-1`` in order (for a
window: relocate and patch that layer, write it into the engine's cache). :meth:`LayerPipeline.wait`
blocks until one layer is loaded for every task, and no longer. A task whose prepare or any
layer fails with a :class:`~contextdeque.core.errors.ContextDequeError` is dropped from that
layer on and reported (:attr:`LayerPipeline.failed`): the engine recomputes what it would have
served. Any other exception is re-raised in the thread that waits.

Run in the background (``background=True``: a worker thread; torch releases the GIL in its
kernels) or inline (``False``: every layer is loaded before :meth:`start` returns — the same
work, no overlap; the baseline a benchmark compares with).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Sequence, TypeVar

from ..core.errors import ArgumentError, ContextDequeError

K = TypeVar("K")

#: ``prepare() -> load_layer``: the whole-model part of a task; ``load_layer(layer)`` loads one layer.
LayerLoader = Callable[[int], None]
Task = Callable[[], LayerLoader]


@dataclass
class PipelineTimes:
    """Where one step's time went, in ms: ``prepare`` (all tasks' whole-model part), ``load[l]``
    (loading layer ``l`` for every task, on the loading thread), ``wait[l]`` (the engine blocked
    in :meth:`LayerPipeline.wait` for layer ``l``), ``compute[l]`` (the engine's time from
    returning from wait ``l`` to asking for layer ``l + 1``: its compute of layer ``l``)."""

    prepare: float = 0.0
    load: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)


class LayerPipeline(Generic[K]):
    """One step's layer-wise loads (see the module docstring).

    Args:
        n_layers: layers every task loads, ``0..n_layers-1``.
        tasks: ``key -> prepare`` (a request id, say); run in this order.
        background: load on a worker thread (overlap), or inline in :meth:`start` (no overlap).
        before_layer: called on the loading thread before each layer is loaded (a test's gate).

    ``trace`` records ``("loaded", l)`` and ``("waited", l)`` in the order they happened: the
    structural record of the overlap.
    """

    def __init__(self, n_layers: int, tasks: Sequence[tuple[K, Task]], *, background: bool = True,
                 before_layer: Callable[[int], None] | None = None) -> None:
        if n_layers <= 0:
            raise ArgumentError(f"n_layers: a layer-wise load needs at least one layer, got {n_layers}")
        self.n_layers = int(n_layers)
        self.tasks = list(tasks)
        self.background = bool(background)
        self.before_layer = before_layer
        self.failed: dict[K, ContextDequeError] = {}
        self.times = PipelineTimes(load=[0.0] * self.n_layers, wait=[0.0] * self.n_layers,
                                   compute=[0.0] * self.n_layers)
        self.trace: list[tuple[str, int]] = []
        self._loaded = [threading.Event() for _ in range(self.n_layers)]
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._last_wait_end: tuple[int, float] | None = None

    # ------------------------------------------------------------------ the loading side
    def start(self) -> "LayerPipeline[K]":
        """Start loading (returns at once in the background; after the last layer inline)."""
        if self.background:
            self._thread = threading.Thread(target=self._run, name="contextdeque-layer-load", daemon=True)
            self._thread.start()
        else:
            self._run()
        return self

    def _run(self) -> None:
        try:
            t0 = time.perf_counter()
            loaders: list[tuple[K, LayerLoader]] = []
            for key, prepare in self.tasks:
                try:
                    loaders.append((key, prepare()))
                except ContextDequeError as exc:
                    self.failed[key] = exc
            self.times.prepare = (time.perf_counter() - t0) * 1000.0
            for layer in range(self.n_layers):
                if self.before_layer is not None:
                    self.before_layer(layer)
                t0 = time.perf_counter()
                for key, load in loaders:
                    if key in self.failed:
                        continue
                    try:
                        load(layer)
                    except ContextDequeError as exc:  # this task stops here; the others go on
                        self.failed[key] = exc
                self.times.load[layer] = (time.perf_counter() - t0) * 1000.0
                self.trace.append(("loaded", layer))
                self._loaded[layer].set()
        except BaseException as exc:  # re-raised where the engine waits; no waiter may hang
            self._error = exc
            for ev in self._loaded:
                ev.set()

    # ------------------------------------------------------------------ the engine's side
    def wait(self, layer: int) -> None:
        """Block until ``layer`` is loaded for every task (or its task failed), and no longer.

        Raises:
            ArgumentError: ``layer`` is outside ``0..n_layers-1``.
            whatever the loading thread raised that is not a ContextDequeError.
        """
        if not 0 <= layer < self.n_layers:
            raise ArgumentError(f"layer {layer} is outside the {self.n_layers} layers this load covers")
        t0 = time.perf_counter()
        if self._last_wait_end is not None and self._last_wait_end[0] < layer:
            prev, end = self._last_wait_end
            self.times.compute[prev] += (t0 - end) * 1000.0
        self._loaded[layer].wait()
        t1 = time.perf_counter()
        self.times.wait[layer] += (t1 - t0) * 1000.0
        self._last_wait_end = (layer, t1)
        self.trace.append(("waited", layer))
        if self._error is not None:
            raise self._error

    def join(self) -> dict[K, ContextDequeError]:
        """Wait for every layer (the step's forward is over); the failed tasks.

        Raises:
            whatever the loading thread raised that is not a ContextDequeError.
        """
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self.failed

    @property
    def done(self) -> bool:
        return all(ev.is_set() for ev in self._loaded)
