"""The idle healer: heals a latency-first window in the background while the agent is busy
elsewhere (waiting on pages, tools or users), then, with anticipation on, prepares the next likely
re-reads (``window.anticipation``: the same steps ``heal()`` runs once nothing is queued).

One daemon thread per healer. It runs a heal step only when the window has pending chunks (an
anticipation pass when it has none and the window changed since the last complete pass) and
no foreground operation ran for ``idle_ms``; during the step it polls, at every decoder layer
and every per-layer loop (``contextdeque.core.cooperative`` checkpoints), whether a foreground
operation is waiting or the healer was stopped, and if so abandons the step (the step is one
window transaction, so the window stays as it was before it) and lets the foreground run. A
foreground operation therefore waits at most for the layer in flight.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from ..core.cooperative import Interrupted, background, install_layer_checkpoints

if TYPE_CHECKING:  # pragma: no cover
    from .window import ContextWindow


class Healer:
    """Background healing of one window. Use :meth:`ContextWindow.start_healing`.

    Attributes (read while it runs or after ``stop()``): ``steps`` heal steps completed,
    ``yielded`` steps abandoned for a foreground operation, ``anticipations`` anticipation passes
    run to completion, ``errors`` exceptions a step raised
    (the window is unchanged by them; the healer keeps going unless ``stop_on_error``).
    """

    def __init__(self, window: "ContextWindow", idle_ms: float = 20.0, poll_ms: float = 2.0, *, stop_on_error: bool = False) -> None:
        self.window = window
        self.idle_ms = float(idle_ms)
        self.poll_ms = float(poll_ms)
        self.stop_on_error = bool(stop_on_error)
        self.steps = 0
        self.anticipations = 0
        self.yielded = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._remove_hooks: Any = None

    def start(self) -> "Healer":
        if self._thread is not None:
            raise RuntimeError("this healer was already started")
        self._remove_hooks = install_layer_checkpoints(self.window.backend.model)
        self._thread = threading.Thread(target=self._loop, name="contextdeque-healer", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop (cancelling a step in flight: the window keeps its state from before it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._remove_hooks is not None:
            self._remove_hooks()
            self._remove_hooks = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until nothing is pending and nothing is left to anticipate (True) or ``timeout``
        seconds pass (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.window.closed or not (self.window.pending_refs or self.window.anticipation_due):
                return True
            if not self.running:
                return False
            time.sleep(self.poll_ms / 1000.0)
        return False

    def __enter__(self) -> "Healer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _should_stop(self) -> bool:
        return self._stop.is_set() or self.window.context.foreground_waiting()

    def _loop(self) -> None:
        ctx = self.window.context
        while not self._stop.is_set():
            idle_s = time.monotonic() - ctx.last_foreground
            win = self.window
            work = not win.closed and (win.pending_refs or win.anticipation_due)
            if not work or idle_s * 1000.0 < self.idle_ms or ctx.foreground_waiting():
                self._stop.wait(self.poll_ms / 1000.0)
                continue
            try:
                with background(self._should_stop):
                    if win.pending_refs:
                        win._heal_step()
                        self.steps += 1
                    else:  # each step one transaction: an interruption discards only the step in flight
                        win._anticipate()
                        self.anticipations += 1
            except Interrupted:
                self.yielded += 1
            except Exception as exc:  # the step was one transaction: the window is unchanged
                self.errors.append(exc)
                if self.stop_on_error:
                    return
                self._stop.wait(self.poll_ms / 1000.0)
