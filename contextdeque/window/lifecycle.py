"""A window's lifecycle: saving and reopening it (sessions), forking, committing, discarding, closing."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..core.errors import WindowError
from .context import foreground_method as _foreground
from .receipt import Meter, Receipt

if TYPE_CHECKING:  # pragma: no cover
    from .window import ContextWindow


class WindowLifecycle:
    """Sessions and forks of a :class:`~.window.ContextWindow` (a mixin over its ``_run``)."""

    # ------------------------------------------------------------------ sessions
    @_foreground
    def save(self, path: "str | os.PathLike[str]") -> Receipt:
        """Save the window to one file at ``path`` (atomic: a crash mid-save leaves what was
        there): order, refs and labels, positions, canonicals and patch stacks, the evicted set
        (with the canonicals the store still holds), pending heals, the conditioning graph,
        policies, budget and a summary of the receipts (``contextdeque.window.session``).
        Reopen it with :meth:`open`."""
        from .session import save_window

        return save_window(self, path)

    @classmethod
    def open(cls, path: "str | os.PathLike[str]", backend: Any, **overrides: Any) -> "ContextWindow":
        """Reopen a window saved with :meth:`save` over ``backend`` (the same model, layout and
        root, else ``SessionError``), running no forward: ``materialize()`` is bit-identical to
        the saved window's, and the session continues (slide, recall, generate...). Refs are
        fresh (same order and labels); ``overrides`` replace saved settings (e.g. ``store=``,
        ``patch_policy=``). ``window.session`` is the manifest it was opened from.

        Raises:
            SessionError: no session there, corrupt, another schema version or another model.
        """
        from .session import open_window

        return open_window(cls, path, backend, **overrides)

    # ------------------------------------------------------------------ forks
    @_foreground
    def fork(self) -> "ContextWindow":
        """A copy-on-write child: shares canonicals, patches and pages (no tensor is copied),
        has its own order, overlay and evicted set. ``child.commit()`` makes the child's state
        the parent's (only if the parent did not change since the fork); ``child.discard()``
        drops it. Nothing the child does changes the parent."""
        self._check_open()
        meter = Meter(self._ctx, "fork")
        child = type(self)._over(self._ctx, self._state.copy(), parent=self)
        meter.notes.extend(self._ctx.store.hold(list(child._state.held_keys().elements()), meter.traffic))
        receipt = meter.finish(refs=child.refs)
        self._record(receipt)
        child._record(receipt)
        return child

    @_foreground
    def commit(self) -> Receipt:
        """Make this fork's state its parent's and close the fork.

        Raises:
            WindowError: not a fork, already closed, or the parent changed since the fork.
        """
        self._check_open()
        parent = self._parent
        if parent is None:
            raise WindowError("commit() is for forks; this window has no parent")
        if parent._closed:
            raise WindowError("the parent window is closed")
        if parent._state.generation != self._base_generation:
            raise WindowError(
                "the parent changed since this fork was made (generation "
                f"{self._base_generation} -> {parent._state.generation}); commit refused"
            )
        meter = Meter(self._ctx, "commit")
        # The child's holds become the parent's; the parent's old state lets go of its own.
        meter.notes.extend(self._ctx.store.release(list(parent._state.held_keys().elements()), meter.traffic))
        new = self._state
        new.generation = parent._state.generation + 1
        parent._state = new
        self._closed = True
        receipt = meter.finish(refs=new.refs)
        parent._record(receipt)
        self._record(receipt)
        return receipt

    def discard(self) -> Receipt:
        """Drop this fork (the parent is untouched)."""
        self._check_open()
        if self._parent is None:
            raise WindowError("discard() is for forks; use close() for a window")
        return self.close(op="discard")

    @_foreground
    def close(self, op: str = "close") -> Receipt:
        """Release everything this window holds in the store; further operations raise."""
        self._check_open()
        meter = Meter(self._ctx, op)
        meter.notes.extend(self._ctx.store.release(list(self._state.held_keys().elements()), meter.traffic))
        self._closed = True
        receipt = meter.finish(refs=self.refs)
        self._record(receipt)
        return receipt
