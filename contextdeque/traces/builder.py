"""TraceBuilder: emit a valid event stream while tracking the window, so generators (and importers)
state *what the agent does* and the builder keeps ids, hashes and membership consistent."""

from __future__ import annotations

import hashlib
from typing import Sequence

from .events import Arrive, Commit, Discard, Event, Evict, Expect, Fork, Query, Recall, Reorder, Slide, Step, TraceHeader
from .io import Trace, trace_from_events


def content_hash(*parts: object) -> str:
    """A short stable content hash for generated chunks (sha256 of the parts' reprs)."""
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:16]


class TraceBuilder:
    """Appends events and mirrors the window: ``window`` (ids in order), ``evicted``, ``tokens``."""

    def __init__(self, header: TraceHeader) -> None:
        self.header = header
        self.events: list[Event] = []
        self.window: list[str] = []
        self.evicted: dict[str, None] = {}  # insertion-ordered set
        self.size: dict[str, int] = {}
        self.hash_of: dict[str, str] = {}
        self._forks: list[tuple[list[str], dict[str, None]]] = []

    @property
    def tokens(self) -> int:
        return sum(self.size[c] for c in self.window)

    def step(self, t: float | None = None, label: str | None = None, idle: float | None = None) -> None:
        self.events.append(Step(t=t, label=label, idle=None if idle is None else round(float(idle), 1)))

    def arrive(self, cid: str, tokens: int, h: str, modality: str = "text", at: int | None = None) -> str:
        """A chunk arrives; an id seen before (and evicted) is recalled instead."""
        if cid in self.window:
            return cid
        if cid in self.size:
            self.recall(cid, at=at)
            return cid
        self.size[cid], self.hash_of[cid] = int(tokens), h
        self.events.append(Arrive(id=cid, modality=modality, tokens=int(tokens), hash=h, at=at))
        self.window.insert(len(self.window) if at is None else at, cid)
        return cid

    def recall(self, cid: str, at: int | None = None) -> None:
        if cid in self.window or cid not in self.evicted:
            return
        del self.evicted[cid]
        self.events.append(Recall(id=cid, at=at))
        self.window.insert(len(self.window) if at is None else at, cid)

    def expect(self, cid: str, at: int | None = None) -> None:
        """The agent says it may recall ``cid`` next (recorded only while it is evicted)."""
        if cid in self.evicted:
            self.events.append(Expect(id=cid, at=at))

    def expect_order(self, order: Sequence[str]) -> None:
        """The agent says it may next reorder the window to ``order`` (every chunk it will hold
        once the recalls it announced are done)."""
        self.events.append(Expect(order=list(order)))

    def evict(self, cid: str) -> None:
        if cid in self.window:
            self.window.remove(cid)
            self.evicted[cid] = None
            self.events.append(Evict(id=cid))

    def slide(self, n: int = 1) -> None:
        n = min(n, len(self.window))
        if n:
            self.evicted.update(dict.fromkeys(self.window[:n]))
            del self.window[:n]
            self.events.append(Slide(n=n))

    def reorder(self, order: Sequence[str]) -> None:
        order = list(order)
        if order != self.window:
            assert sorted(order) == sorted(self.window)
            self.window = order
            self.events.append(Reorder(order=order))

    def query(self, tokens: int, output_tokens: int, text: str | None = None, answer: str | None = None) -> None:
        self.events.append(Query(tokens=int(tokens), output_tokens=int(output_tokens), text=text, answer=answer))

    def fork(self, name: str | None = None) -> None:
        self._forks.append((list(self.window), dict(self.evicted)))
        self.events.append(Fork(name=name))

    def commit(self, name: str | None = None) -> None:
        self._forks.pop()
        self.events.append(Commit(name=name))

    def discard(self, name: str | None = None) -> None:
        self.window, self.evicted = self._forks.pop()
        self.events.append(Discard(name=name))

    def build(self, name: str | None = None) -> Trace:
        """The validated trace (the same whole-trace checks a file gets)."""
        while self._forks:
            self.discard()
        return trace_from_events(self.header, self.events, name=name)
