"""What a window shows without changing it: its order, slots, KV, patches, text and table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.chunk import Chunk
from ..core.errors import WindowError
from ..core.kv import LayerKV
from ..patch import Patch
from . import decode
from .context import WindowContext
from .graph import ConditioningGraph
from .policy import PatchPolicy
from .ref import ChunkRef
from .slot import Slot
from .staleness import staleness
from .store import WindowStore

if TYPE_CHECKING:  # pragma: no cover
    from .window import ContextWindow


class WindowIntrospection:
    """Read-only properties and views of a :class:`~.window.ContextWindow` (a mixin: it reads the
    window's ``_ctx`` and ``_state``)."""

    # ================================================================== introspection
    @property
    def backend(self) -> Any:
        """The backend (a view carrying the window's root if one was given)."""
        return self._ctx.backend

    @property
    def context(self) -> WindowContext:
        """The explicit shared context (backend, store, policy, counters)."""
        return self._ctx

    @property
    def policy(self) -> PatchPolicy:
        return self._ctx.policy

    @property
    def store(self) -> WindowStore:
        return self._ctx.store

    @property
    def graph(self) -> ConditioningGraph:
        """The conditioning graph (read it; the window keeps it in sync)."""
        return self._state.graph

    @property
    def refs(self) -> tuple[ChunkRef, ...]:
        """The chunks in the window, in order."""
        return self._state.refs

    @property
    def evicted_refs(self) -> tuple[ChunkRef, ...]:
        """Evicted chunks that can be recalled."""
        return tuple(self._state.evicted)

    @property
    def tokens_used(self) -> int:
        """Chunk tokens in the window (root excluded)."""
        return self._state.tokens_used

    @property
    def budget_tokens(self) -> int | None:
        return self._ctx.budget_tokens

    @property
    def root_ids(self) -> tuple[int, ...]:
        return tuple(self._ctx.backend.root_ids)

    @property
    def stale_refs(self) -> tuple[ChunkRef, ...]:
        """Chunks flagged stale by a recall cascade (``cascade_policy="flag"``)."""
        return tuple(s.ref for s in self._state.slots if s.stale)

    @property
    def parent(self) -> "ContextWindow | None":
        return self._parent

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def generation(self) -> int:
        """Counts successful state-changing operations."""
        return self._state.generation

    def __len__(self) -> int:
        return len(self._state.slots)

    def __contains__(self, ref: object) -> bool:
        return any(s.ref == ref for s in self._state.slots)

    def placement(self) -> list[tuple[ChunkRef, int, int]]:
        """``(ref, start, end)`` per chunk: contiguous from ``root_len`` on."""
        return [(s.ref, s.start, s.end) for s in self._state.slots]

    def next_position(self) -> int:
        """Position of the first token after the window."""
        return decode.next_position(self._ctx, self._state.slots)

    def slot(self, ref: ChunkRef) -> Slot:
        """The slot of an in-window chunk (read-only record)."""
        return self._state.slots[self._state.index(ref)]

    def kv(self, ref: ChunkRef) -> list[LayerKV]:
        """The KV the model sees for ``ref``: per layer ``(k [H_k, T, d_k], v [H_v, T, d_v])``."""
        page = self.slot(ref).page
        assert page is not None
        return list(page)

    def patches(self, ref: ChunkRef) -> tuple[Patch, ...]:
        """The conditioning patches ``ref`` carries (empty: blind canonical)."""
        return self.slot(ref).patches

    def chunk(self, ref: ChunkRef) -> Chunk:
        return self.slot(ref).chunk

    def cascade_preview(self, ref: ChunkRef) -> tuple[ChunkRef, ...]:
        """In-window chunks transitively conditioned on ``ref`` (at most what recalling it
        would make stale)."""
        return self._state.graph.preview_cascade(ref, self.refs)

    def text(self, *, root: bool = False) -> str:
        """What the window holds, as text: each chunk's tokens decoded, concatenated exactly as
        the model sees them (no separator is added: see ``chunk_template``); an image chunk
        appears as ``[image: N tokens]``. ``root=True`` starts with the root.

        Raises:
            WindowError: the backend has no tokenizer.
        """
        tok = self._ctx.backend.tokenizer
        if tok is None:
            raise WindowError("text() needs a tokenizer; this backend has none (read window.chunk(ref).token_ids)")
        parts = [tok.decode(list(self.root_ids))] if root else []
        for s in self._state.slots:
            ids = s.chunk.token_ids
            parts.append(tok.decode(ids.tolist()) if ids is not None else f"[{s.chunk.modality}: {s.n_tokens} tokens]")
        return "".join(parts)

    def table(self) -> Any:
        """The window as a ``rich`` table (see :meth:`show`)."""
        from .view import window_table

        return window_table(self)

    def show(self, console: Any = None) -> None:
        """Print the window as a table: per chunk its position span, tokens, label, conditioning
        (patch kind@rank, or blind), staleness and the store tier of its canonical; evicted chunks
        after it. ``console``: a ``rich.console.Console`` (default: stdout). Returns None (a REPL
        echoes nothing after the table); :meth:`table` returns the table itself."""
        from rich.console import Console

        (console or Console()).print(self.table())

    def __repr__(self) -> str:
        b = "" if self._ctx.budget_tokens is None else f"/{self._ctx.budget_tokens}"
        kind = "fork" if self._parent is not None else "window"
        return (
            f"ContextWindow({kind}, {len(self)} chunks, {self.tokens_used}{b} tokens, "
            f"{len(self._state.evicted)} evicted, policy={self._ctx.policy.name})"
        )
