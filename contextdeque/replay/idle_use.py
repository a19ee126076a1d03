"""What idle-time anticipation forms that no later step uses: the agents' generated traces run on a
real latency-first window twice, with anticipation off and on, ``heal()`` run to completion at
every ``step`` (the agent's idle time, ``replay.live.drive_window``), and the two compared.

Anticipation moves work a later heal would do anyway off the critical path; what it forms beyond
that is waste. So the *extra* forwards and tokens of the anticipating run (over the run without)
are what anticipation formed that no step used, and the anticipated patches a step was served
(``Receipt.served == "anticipated"``), against the ones anticipation formed
(``WindowContext.anticipated_keys``, per kind), say how much of it was used. The anticipation hit
rate (``replay.hits``) shows what the work bought.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..traces.io import Trace
from ..window.receipt import Receipt
from .fidelity import DEFAULT_SCALE, scaled_chunk_ids
from .hits import HitRate
from .live import drive_window


@dataclass
class IdleUseRow:
    """One trace, one anticipation setting: the window's total work (critical path and idle),
    the re-read hit rate, and (anticipating) the anticipated patches formed and served."""

    trace: str
    anticipate: bool
    forwards: int
    tokens: int
    hit_rate: float | None
    own_hit_rate: float | None
    formed: Counter = field(default_factory=Counter)  # anticipated patches formed, by kind
    served: int = 0  # chunk placements served an anticipated patch or prepared re-forward

    def as_dict(self) -> dict[str, Any]:
        return {"trace": self.trace, "anticipate": self.anticipate, "forwards": self.forwards, "tokens": self.tokens,
                "hit_rate": self.hit_rate, "own_hit_rate": self.own_hit_rate, "formed": dict(self.formed), "served": self.served}


def _kind_of(key: str) -> str:
    """The stored kind named in a patch store key (``patch.keys.patch_key_parts``)."""
    for part in reversed(str(key).replace(":", "/").split("/")):
        if part in ("exact", "orbit", "recall", "removal", "deep", "shared"):
            return part
    return "other"


def idle_use(backend: Any, trace: Trace, *, policy: str = "latency", anticipate: bool = True,
             scale: float = DEFAULT_SCALE, window_options: dict[str, Any] | None = None) -> IdleUseRow:
    """Drive ``trace`` on a ``policy`` window (``anticipate`` as given), healing to completion at
    every step; chunk sizes scaled by ``scale`` as ``replay --fidelity`` scales them."""
    from ..window import ContextWindow

    win = ContextWindow(backend, patch_policy=policy, anticipate=anticipate, **(window_options or {}))
    hits = HitRate()
    served = 0

    def on_step(step: str, receipt: Receipt) -> None:
        nonlocal served
        hits.add(step, receipt)
        served += sum(1 for _, what in receipt.served if what == "anticipated")

    total = drive_window(win, trace, scaled_chunk_ids(backend, scale), on_step=on_step)
    formed = Counter(_kind_of(k) for k in win._ctx.anticipated_keys)
    row = IdleUseRow(trace.name, anticipate, total.forwards, total.tokens_prefilled, hits.rate(), hits.rate(own=True), formed,
                     served)
    win.close()
    return row


def idle_use_table(backend: Any, traces: Sequence[Trace], **kw: Any) -> list[IdleUseRow]:
    """:func:`idle_use` of each trace without and with anticipation (in that order)."""
    return [idle_use(backend, t, anticipate=a, **kw) for t in traces for a in (False, True)]
