"""Agent traces (issue 11): a versioned JSONL format of pydantic-validated events, whole-trace
validation, seeded generators for web / video / document agents, and the Mooncake importer.

    from contextdeque.traces import generate, read_trace, write_trace
    trace = generate("web", seed=0)
    write_trace("web-0.jsonl", trace.header, trace.events)
    again = read_trace("web-0.jsonl")          # validated whole before anything uses it
"""

from . import gen_doc, gen_video, gen_web  # noqa: F401  (register generators)
from .builder import TraceBuilder, content_hash
from .events import (
    FORMAT,
    FORMAT_VERSION,
    OPS,
    Arrive,
    Commit,
    Discard,
    Event,
    Evict,
    Expect,
    Fork,
    Query,
    Recall,
    Reorder,
    Slide,
    Step,
    TraceHeader,
)
from .generators import GENERATORS, generate
from .io import Trace, check_trace, idle_gaps, parse_event, parse_header, read_trace, scaled_trace, trace_from_events, write_trace
from .mooncake import BLOCK_TOKENS, import_mooncake

__all__ = [
    "FORMAT", "FORMAT_VERSION", "OPS", "TraceHeader", "Event", "Arrive", "Query", "Slide", "Reorder", "Evict", "Expect", "Recall",
    "Fork", "Commit", "Discard", "Step", "Trace", "read_trace", "write_trace", "check_trace", "parse_event",
    "parse_header", "idle_gaps", "scaled_trace", "trace_from_events", "TraceBuilder", "content_hash", "GENERATORS", "generate",
    "import_mooncake", "BLOCK_TOKENS",
]
