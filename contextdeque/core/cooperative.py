"""Cooperative yield points for background work that shares the model with foreground calls.

A background worker (the window's idle healer) runs its work under :func:`background` with a
token; the long loops it drives — every decoder layer's forward (through hooks the worker
installs) and the per-layer loops of patch formation and page placement — call
:func:`checkpoint`. On the foreground thread ``checkpoint`` is a thread-local lookup and
nothing else; on the worker it raises :class:`Interrupted` as soon as the token says stop, so a
foreground operation waits at most for the layer in flight.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

_local = threading.local()


class Interrupted(Exception):
    """Raised inside background work at a checkpoint when its token asks it to stop (a
    foreground operation is waiting, or the work was cancelled)."""


@contextmanager
def background(should_stop: Callable[[], bool]) -> Iterator[None]:
    """Run the enclosed work with ``should_stop`` polled at every checkpoint (this thread only)."""
    previous = getattr(_local, "should_stop", None)
    _local.should_stop = should_stop
    try:
        yield
    finally:
        _local.should_stop = previous


def in_background() -> bool:
    """This thread is running background work."""
    return getattr(_local, "should_stop", None) is not None


def checkpoint() -> None:
    """Give way here if this thread's background work was asked to stop."""
    should_stop = getattr(_local, "should_stop", None)
    if should_stop is not None and should_stop():
        raise Interrupted("background work interrupted at a checkpoint")


def install_layer_checkpoints(model: object) -> Callable[[], None]:
    """A ``checkpoint()`` before every decoder layer of ``model`` (each element of a module list
    named ``layers``); returns the function that removes them."""
    import torch

    handles = []
    for name, module in model.named_modules():  # type: ignore[attr-defined]
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers":
            for layer in module:
                handles.append(layer.register_forward_pre_hook(lambda _m, _a: checkpoint()))

    def remove() -> None:
        for h in handles:
            h.remove()

    return remove
