"""The antecedent states a patch's store key names (``patch.keys.kv_state``): what makes a stored
patch valid exactly where the KV in front of the chunk is the KV it was formed on.

A slot's state is its chunk and the store keys of the patches it carries (each key names the
states its patch was formed on, so the name is recursive and window-independent); a provisional
slot's (latency-first new content, ``KV(B | what was in front)``) is its chunk and the states it
ran after. Orbit-like kinds (``PatchKind.ordered = False``) serve every ordering of a set: there
an antecedent conditioned exactly on what precedes it in the window (*settled*: the eager policy's
state in any ordering of the set) is named by its chunk alone, one that is not (blind, stale: a
latency-first stand-in) by its full state, so a patch formed on settled antecedents is never
served behind unsettled ones.
"""

from __future__ import annotations

from typing import Sequence

from ..patch.keys import kv_state
from .slot import Slot


def slot_state(slot: Slot, states_before: Sequence[str], settled: bool) -> str:
    """``slot``'s KV state, given the states of the slots in front of it (see the module doc)."""
    if not slot.provisional:
        return slot.state
    if settled:  # its forward ran after exactly the KV in front of it
        return kv_state(slot.chunk.id, ["inline", *states_before])
    return kv_state(slot.chunk.id, ["inline-on", *(f"{r.key}:{v}" for r, v in slot.inline_on)])


def antecedent_states(prefix: Sequence[Slot], *, ordered: bool = True) -> list[str]:
    """The names of ``prefix``'s KV states, in window order, for a patch key: each slot's full
    state (``ordered``), or for an orbit-like kind its chunk alone where it is settled."""
    states: list[str] = []
    out: list[str] = []
    tags: list = []
    for slot in prefix:
        settled = slot.conditioned_on == tuple(tags)
        state = slot_state(slot, states, settled)
        states.append(state)
        out.append(state if ordered or not settled else kv_state(slot.chunk.id, ["settled"]))
        tags.append((slot.ref, slot.version))
    return out
