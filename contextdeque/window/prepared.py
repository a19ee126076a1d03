"""Prepared re-forwards: the conditioned forwards of provisional chunks that anticipation ran in
idle time, for the step that would otherwise defer them to ``heal``.

A latency-first window keeps new content *provisional* (``KV(B | what was in front)``, no
canonical). When a re-read makes the eager policy re-condition such a chunk — the recall cascade
(the chunk was conditioned on the recalled one, which now sits behind it or came back changed),
a reorder that moves it — the window defers it (served ``"conditioned"``) and ``heal`` later runs
one conditioned forward of it behind its new prefix (``ingest.reforward``). Anticipation runs
that very forward on its simulated arrangement (consecutive chunks in one forward of their
concatenation, ``ingest.reforward_run``: the same KV) and keeps the result here, keyed by the chunk and
the KV states in front of it (``window.kvstate``, as patch keys are); the step that lands in that
arrangement takes it (``reconcile``), 0 forwards, and holds exactly what the heal would have
built. Any other arrangement has other keys and finds nothing.

Entries are KV of whole chunks (as large as a canonical) that are useful for the next step only,
so they live in memory, in the window family's context, bounded (:data:`MAX_ENTRIES`,
:data:`MAX_BYTES`; the oldest go first), and not in the store.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable, Sequence

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
    """The prepared re-forwards of one window family (see the module doc), bounded by the rule the
    replay's mirror shares (``replay/anticipate.py``, keys only: ``nbytes=0``).

    Which entries stay when the bound is reached: those of earlier anticipation passes
    (:meth:`new_pass`) go first, oldest first; an entry the current pass put or found (a later
    prediction through the same arrangement, the step that takes it) belongs to the current pass.
    Within the current pass a new entry that does not fit is not kept: anticipation prepares its
    predictions best first, so the later one is the less likely (dropping the oldest instead threw
    away the best prediction's dependents whenever a pass prepared more than the bound holds)."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries, self.max_bytes = int(max_entries), int(max_bytes)
        self._entries: OrderedDict[Hashable, tuple[int, Any, int]] = OrderedDict()  # key -> (pass, value, bytes)
        self.nbytes = 0
        self.passes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def new_pass(self) -> None:
        """An anticipation pass begins: what earlier passes kept goes first from now on."""
        self.passes += 1

    def put(self, key: Hashable, value: Any, nbytes: int | None = None) -> bool:
        """Keep ``value`` (a provisional chunk's KV: its ``nbytes`` unless given) under ``key``.
        Returns whether it was kept (see the class doc)."""
        size = int(value.nbytes if nbytes is None else nbytes)
        self._drop(key)
        while self._entries and self._over(size):
            oldest, (made_in, _, _) = next(iter(self._entries.items()))
            if made_in >= self.passes:  # only the current pass's left: they are the likelier ones
                return False
            self._drop(oldest)
        if self._over(size):
            return False
        self._entries[key] = (self.passes, value, size)
        self.nbytes += size
        return True

    def get(self, key: Hashable) -> Any:
        """The value kept under ``key`` (None: none); found, it belongs to the current pass."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries[key] = (self.passes, entry[1], entry[2])
        self._entries.move_to_end(key)
        return entry[1]

    def _over(self, size: int) -> bool:
        return len(self._entries) + 1 > self.max_entries or self.nbytes + size > self.max_bytes

    def _drop(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[2]
