"""Seeded trace generators for the three agent kinds (one file each: ``gen_web``, ``gen_video``,
``gen_doc``), registered in :data:`GENERATORS` by name.

Sizes follow what the models in this SDK's scope produce: a screenshot or a video frame becomes
hundreds to thousands of tokens (Qwen2-VL: one token per 28x28 px patch, so a 1280x720 screenshot
is ~1,170 tokens and a 448x448 frame 256), page text and accessibility trees hundreds, agent
messages tens.
"""

from __future__ import annotations

import random
from typing import Callable

from .events import TraceHeader
from .io import Trace

GENERATORS: dict[str, Callable[..., Trace]] = {}


def register_generator(name: str) -> Callable[[Callable[..., Trace]], Callable[..., Trace]]:
    def deco(fn: Callable[..., Trace]) -> Callable[..., Trace]:
        GENERATORS[name] = fn
        return fn

    return deco


def header(kind: str, seed: int, **meta: object) -> TraceHeader:
    return TraceHeader(generator=kind, agent=f"{kind}-agent (generated)", seed=seed, meta=dict(meta))


def rng_for(kind: str, seed: int) -> random.Random:
    """One independent stream per (kind, seed): string seeding is stable across runs."""
    return random.Random(f"contextdeque-trace:{kind}:{seed}")


def generate(kind: str, seed: int = 0, **kw: object) -> Trace:
    """A generated trace of ``kind`` (``web``, ``video``, ``doc``)."""
    from ..core.errors import TraceError
    from . import gen_doc, gen_video, gen_web  # noqa: F401  (register)

    if kind not in GENERATORS:
        raise TraceError(f"unknown trace kind {kind!r}; known: {sorted(GENERATORS)}", field="kind")
    return GENERATORS[kind](seed=seed, **kw)
