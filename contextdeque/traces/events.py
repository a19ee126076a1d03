"""Trace events: one pydantic model per kind of line in a contextdeque trace (format version 1).

A trace is JSONL: line 1 is a :class:`TraceHeader`, every further line one event, told apart by
its ``"op"``. Chunks are named by the trace (``id``: the agent's handle for one chunk in its
window) and carry a content ``hash``: two ids with one hash are the same content (a store hit),
one id is one chunk instance (``recall`` brings that instance back).

=========  =======================================================================
op         meaning
=========  =======================================================================
arrive     a chunk enters the window at the end (or at index ``at``)
query      the agent reads the window (``tokens`` of question, ``output_tokens``)
slide      the ``n`` oldest chunks leave the window (recallable)
reorder    the window is permuted to ``order`` (every in-window id exactly once)
evict      one chunk leaves the window (recallable)
recall     an evicted chunk comes back (at the end, or at index ``at``)
fork       a copy-on-write branch of the window starts (nested forks stack)
commit     the innermost branch becomes the window
discard    the innermost branch is dropped; the window is as before the fork
expect     the agent says it may recall this evicted chunk next (at the end, or at ``at``): a
           hint (``ContextWindow.expect``), the window does not change; or, with ``order``,
           that it may next reorder the window to ``order`` (``ContextWindow.expect_order``)
step       boundary between agent steps (``t``: milliseconds since the trace began; ``idle``:
           milliseconds the window then sits idle: a tool runs, a page loads, the user types)
=========  =======================================================================
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

FORMAT = "contextdeque-trace"
FORMAT_VERSION = 1
MODALITIES = ("text", "image", "frame")

ChunkId = Annotated[str, Field(min_length=1, max_length=200)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TraceHeader(_Strict):
    """Line 1 of every trace: format name and version, who wrote it, free-form metadata."""

    format: Literal["contextdeque-trace"] = FORMAT
    version: int = Field(FORMAT_VERSION, ge=1)
    generator: str = Field(min_length=1, description="what wrote the trace: web / video / doc / mooncake / an agent's name")
    agent: str | None = None
    seed: int | None = None
    meta: dict[str, Any] = Field(default_factory=dict)


class Arrive(_Strict):
    op: Literal["arrive"] = "arrive"
    id: ChunkId
    modality: Literal["text", "image", "frame"] = "text"
    tokens: int = Field(ge=1, le=10_000_000)
    hash: str = Field(min_length=1, max_length=200)
    at: int | None = Field(None, ge=0)


class Query(_Strict):
    op: Literal["query"] = "query"
    tokens: int = Field(16, ge=1, le=10_000_000)
    output_tokens: int = Field(16, ge=0, le=10_000_000)
    text: str | None = None
    answer: str | None = None


class Slide(_Strict):
    op: Literal["slide"] = "slide"
    n: int = Field(1, ge=1)


class Reorder(_Strict):
    op: Literal["reorder"] = "reorder"
    order: list[ChunkId] = Field(min_length=1)


class Evict(_Strict):
    op: Literal["evict"] = "evict"
    id: ChunkId


class Recall(_Strict):
    op: Literal["recall"] = "recall"
    id: ChunkId
    at: int | None = Field(None, ge=0)


class Fork(_Strict):
    op: Literal["fork"] = "fork"
    name: str | None = None


class Commit(_Strict):
    op: Literal["commit"] = "commit"
    name: str | None = None


class Discard(_Strict):
    op: Literal["discard"] = "discard"
    name: str | None = None


class Expect(_Strict):
    """A hint: ``id`` may be recalled next (at the end, or at ``at``); or, with ``order`` instead,
    the window may next be reordered to ``order`` (every chunk it holds once the recalls the
    agent announced are done: ``ContextWindow.expect_order``)."""

    op: Literal["expect"] = "expect"
    id: ChunkId | None = None
    at: int | None = Field(None, ge=0)
    order: list[ChunkId] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_hint(self) -> "Expect":
        if (self.id is None) == (self.order is None):
            raise ValueError("expect names either a chunk (id) or an order, not both")
        if self.order is not None and self.at is not None:
            raise ValueError("expect: at goes with id, not with order")
        return self


class Step(_Strict):
    """A boundary between agent steps: ``t`` (ms since the trace began), ``idle`` (ms the window
    sits idle here before the next event: the agent waits on a tool, a page load, the user; the
    replay heals and anticipates in it, ``contextdeque replay --fidelity --idle-rate``). Without
    ``idle`` the replay takes the time since the previous timed step (an upper bound)."""

    op: Literal["step"] = "step"
    t: float | None = Field(None, ge=0)
    label: str | None = None
    idle: float | None = Field(None, ge=0)


Event = Annotated[
    Union[Arrive, Query, Slide, Reorder, Evict, Recall, Fork, Commit, Discard, Expect, Step],
    Field(discriminator="op"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
OPS = ("arrive", "query", "slide", "reorder", "evict", "recall", "fork", "commit", "discard", "expect", "step")
