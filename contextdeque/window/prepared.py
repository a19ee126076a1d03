"""Prepared re-forwards: the conditioned forwards of provisional chunks that anticipation ran in
idle time, for the step that would otherwise defer them to ``heal``.

A latency-first window keeps new content *provisional* (``KV(B | what was in front)``, no
canonical). When a re-read makes the eager policy re-condition such a chunk — the recall cascade
(the chunk was conditioned on the recalled one, which now sits behind it or came back changed),
a reorder that moves it — the window defers it (served ``"conditioned"``) and ``heal`` later runs
one conditioned forward of it behind its new prefix (``ingest.reforward``). Anticipation runs
that very forward on its simulated arrangement and keeps the result here, keyed by the chunk and
the KV states in front of it (``window.kvstate``, as patch keys are); the step that lands in that
arrangement takes it (``reconcile``), 0 forwards, and holds exactly what the heal would have
built. Any other arrangement has other keys and finds nothing.

Entries are KV of whole chunks (as large as a canonical) that are useful for the next step only,
so they live in memory, in the window family's context, bounded (:data:`MAX_ENTRIES`,
:data:`MAX_BYTES`; the oldest go first), and not in the store.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from ..core.chunk import Chunk
from ..patch.keys import kv_state
from .kvstate import antecedent_states
from .slot import Slot

MAX_ENTRIES = 256
"""Prepared re-forwards a window family keeps (the oldest go first)."""

MAX_BYTES = 1 << 30
"""Bytes of prepared KV a window family keeps (the oldest go first)."""


def prepared_key(chunk_id: str, prefix: Sequence[Slot]) -> str:
    """The key of ``chunk_id``'s conditioned forward behind ``prefix``: its content and the KV
    states in front of it, in order."""
    return kv_state(chunk_id, ["prepared", *antecedent_states(prefix)])


class PreparedForwards:
    """The prepared re-forwards of one window family (see the module doc)."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries, self.max_bytes = int(max_entries), int(max_bytes)
        self._entries: OrderedDict[str, Chunk] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: str, chunk: Chunk) -> None:
        """Keep ``chunk`` (a provisional chunk's KV) under ``key``."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._entries[key] = chunk
        self.nbytes += chunk.nbytes
        while self._entries and (len(self._entries) > self.max_entries or self.nbytes > self.max_bytes):
            _, dropped = self._entries.popitem(last=False)
            self.nbytes -= dropped.nbytes

    def get(self, key: str) -> Chunk | None:
        """The KV prepared under ``key``, or None."""
        return self._entries.get(key)
