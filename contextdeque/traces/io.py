"""Reading, validating and writing traces.

:func:`read_trace` parses every line with the pydantic models of :mod:`.events` and then checks the
trace *whole* (:func:`check_trace`: every id an event names exists where the event says, reorders
are permutations, forks are closed in order) before returning it, so a consumer never acts on a
trace that fails half-way. Every refusal is a :class:`~contextdeque.core.errors.TraceError` carrying the
path, the 1-based line number (the header is line 1) and the offending field.
"""

from __future__ import annotations

import gzip
import io
import json
import lzma
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable, Iterator, Sequence

from pydantic import ValidationError

from ..core.errors import TraceError, TraceVersionError, UnknownChunkError
from .events import EVENT_ADAPTER, FORMAT, FORMAT_VERSION, OPS, Arrive, Event, TraceHeader


@dataclass
class Trace:
    """A validated trace: its ``header`` and ``events`` (line ``i + 2`` of the file is event ``i``)."""

    header: TraceHeader
    events: list[Event]
    path: str | None = None
    chunks: dict[str, Arrive] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """A short name: the file's stem, else the generator."""
        if self.path:
            n = Path(self.path).name
            for suffix in (".gz", ".xz", ".jsonl"):
                n = n[: -len(suffix)] if n.endswith(suffix) else n
            return n
        return self.header.generator

    def line_of(self, index: int) -> int:
        return index + 2

    def __len__(self) -> int:
        return len(self.events)


def _open_text(path: str | os.PathLike) -> IO[str]:
    p = str(path)
    if p.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(p, "rb"), encoding="utf-8")
    if p.endswith(".xz"):
        return io.TextIOWrapper(lzma.open(p, "rb"), encoding="utf-8")
    return open(p, encoding="utf-8")


def _field_of(exc: ValidationError) -> tuple[str | None, str]:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ())]
    # a discriminated union puts the op name first: report the field inside the event
    if len(loc) > 1 and loc[0] in OPS:
        loc = loc[1:]
    fld = ".".join(loc) or None
    msg = err.get("msg", "invalid")
    if err.get("type") == "union_tag_invalid" or err.get("type") == "union_tag_not_found":
        fld = "op"
    more = len(exc.errors()) - 1
    return fld, msg + (f" (and {more} more problem(s) on this line)" if more > 0 else "")


def parse_header(text: str, *, path: str | None = None) -> TraceHeader:
    """The header from line 1's text; refuses a newer format version with TraceVersionError."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"the header is not JSON ({exc.msg} at column {exc.colno})", path=path, line=1) from None
    if not isinstance(raw, dict):
        raise TraceError("the header must be a JSON object", path=path, line=1)
    if raw.get("format") != FORMAT:
        raise TraceError(f"not a contextdeque trace: format is {raw.get('format')!r}, expected {FORMAT!r}", path=path, line=1, field="format")
    version = raw.get("version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise TraceVersionError(
            f"trace format version {version} is newer than this contextdeque reads ({FORMAT_VERSION}); upgrade contextdeque",
            path=path, line=1, field="version",
        )
    try:
        return TraceHeader.model_validate(raw)
    except ValidationError as exc:
        fld, msg = _field_of(exc)
        raise TraceError(msg, path=path, line=1, field=fld) from None


def parse_event(text: str, *, path: str | None = None, line: int | None = None) -> Event:
    """One event from one line's text (TraceError with the line and field when malformed)."""
    try:
        return EVENT_ADAPTER.validate_json(text)
    except ValidationError as exc:
        if exc.errors() and exc.errors()[0].get("type") == "json_invalid":
            raise TraceError(f"not valid JSON ({exc.errors()[0].get('msg')})", path=path, line=line) from None
        fld, msg = _field_of(exc)
        raise TraceError(msg, path=path, line=line, field=fld) from None


def iter_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of the non-blank lines of a (possibly .gz / .xz) file."""
    with _open_text(path) as f:
        for no, text in enumerate(f, start=1):
            if text.strip():
                yield no, text


def read_trace(path: str | os.PathLike, *, check: bool = True) -> Trace:
    """Parse and validate a whole trace file (``.jsonl``, ``.jsonl.gz`` or ``.jsonl.xz``).

    Raises:
        TraceError: a line is not JSON or not a valid event (line + field), the header is missing
            or malformed, or (``check``) the events are inconsistent (see :func:`check_trace`).
        TraceVersionError: the header's version is newer than :data:`FORMAT_VERSION`.
        FileNotFoundError: no such file.
    """
    p = str(path)
    lines = iter_lines(p)
    first = next(lines, None)
    if first is None:
        raise TraceError("empty trace: line 1 must be the header", path=p, line=1)
    no, text = first
    if no != 1:
        raise TraceError("line 1 must be the header (blank lines before it)", path=p, line=1)
    header = parse_header(text, path=p)
    events: list[Event] = []
    line_nos: list[int] = []
    for no, text in lines:
        events.append(parse_event(text, path=p, line=no))
        line_nos.append(no)
    trace = Trace(header=header, events=events, path=p)
    if check:
        trace.chunks = check_trace(trace, line_nos=line_nos)
    return trace


def check_trace(trace: Trace, *, line_nos: Sequence[int] | None = None) -> dict[str, Arrive]:
    """Check the events whole, simulating the window's membership (forks included).

    Returns the chunks by id (their ``arrive`` event). Raises UnknownChunkError for an event naming
    an id that is not where it says (never arrived, not in the window, not evicted), TraceError for
    the rest (a duplicate id, a reorder that is no permutation, a slide past the window, an ``at``
    out of range, a commit/discard without a fork, one chunk id with two contents).
    """
    path = trace.path
    chunks: dict[str, Arrive] = {}
    window: list[str] = []
    evicted: set[str] = set()
    stack: list[tuple[list[str], set[str], str | None]] = []
    for i, ev in enumerate(trace.events):
        line = line_nos[i] if line_nos is not None else i + 2

        def fail(msg: str, fld: str | None = None, cls: type[TraceError] = TraceError) -> TraceError:
            return cls(msg, path=path, line=line, field=fld)

        op = ev.op
        if op == "arrive":
            if ev.id in chunks:
                known = chunks[ev.id]
                if known.hash != ev.hash or known.tokens != ev.tokens:
                    raise fail(f"chunk {ev.id!r} arrived before with other content (hash/tokens)", "id")
                if ev.id in window:
                    raise fail(f"chunk {ev.id!r} is already in the window (recall or reorder it)", "id")
                evicted.discard(ev.id)
            chunks[ev.id] = ev
            at = len(window) if ev.at is None else ev.at
            if at > len(window):
                raise fail(f"at={ev.at} is past the window's {len(window)} chunk(s)", "at")
            window.insert(at, ev.id)
        elif op == "slide":
            if ev.n > len(window):
                raise fail(f"cannot slide {ev.n} chunk(s) out of a window of {len(window)}", "n")
            evicted.update(window[: ev.n])
            del window[: ev.n]
        elif op == "evict":
            if ev.id not in window:
                why = "evicted already" if ev.id in evicted else "never arrived" if ev.id not in chunks else "not in the window"
                raise fail(f"cannot evict chunk {ev.id!r}: {why}", "id", UnknownChunkError)
            window.remove(ev.id)
            evicted.add(ev.id)
        elif op == "recall":
            if ev.id not in evicted:
                why = "it is in the window" if ev.id in window else "it never arrived" if ev.id not in chunks else "it is not evicted"
                raise fail(f"cannot recall chunk {ev.id!r}: {why}", "id", UnknownChunkError)
            at = len(window) if ev.at is None else ev.at
            if at > len(window):
                raise fail(f"at={ev.at} is past the window's {len(window)} chunk(s)", "at")
            evicted.discard(ev.id)
            window.insert(at, ev.id)
        elif op == "expect" and ev.order is not None:
            unknown = [c for c in ev.order if c not in chunks]
            if unknown:
                raise fail(f"expect names chunk(s) that never arrived: {unknown[:5]}", "order", UnknownChunkError)
            if len(set(ev.order)) != len(ev.order):
                raise fail("expect: an order names each chunk once", "order")
        elif op == "expect":
            if ev.id not in chunks:
                raise fail(f"cannot expect chunk {ev.id!r}: it never arrived", "id", UnknownChunkError)
        elif op == "reorder":
            unknown = [c for c in ev.order if c not in window]
            if unknown:
                raise fail(f"reorder names chunk(s) not in the window: {unknown[:5]}", "order", UnknownChunkError)
            if len(ev.order) != len(window) or len(set(ev.order)) != len(ev.order):
                raise fail(f"reorder must name each of the window's {len(window)} chunks exactly once, got {len(ev.order)}", "order")
            window = list(ev.order)
        elif op == "fork":
            stack.append((list(window), set(evicted), ev.name))
        elif op in ("commit", "discard"):
            if not stack:
                raise fail(f"{op} without an open fork", "op")
            saved_w, saved_e, name = stack.pop()
            if ev.name is not None and name is not None and ev.name != name:
                raise fail(f"{op} {ev.name!r} does not close the innermost fork {name!r}", "name")
            if op == "discard":
                window, evicted = saved_w, saved_e
    if stack:
        raise TraceError(f"{len(stack)} fork(s) never committed or discarded", path=path, line=(line_nos[-1] if line_nos else len(trace.events) + 1))
    return chunks


def idle_gaps(trace: Trace) -> dict[int, float]:
    """Milliseconds the window sits idle at each ``step`` event (by event index): its ``idle``;
    else the time since the previous step with a time ``t`` (an upper bound: the replay does not
    know how much of it the model spent answering); else 0."""
    out: dict[int, float] = {}
    last_t: float | None = None
    for i, ev in enumerate(trace.events):
        if ev.op != "step":
            continue
        if ev.idle is not None:
            out[i] = float(ev.idle)
        elif ev.t is not None and last_t is not None:
            out[i] = max(0.0, float(ev.t) - last_t)
        else:
            out[i] = 0.0
        if ev.t is not None:
            last_t = float(ev.t)
    return out


def scaled_trace(trace: Trace, scale: float, minimum: int = 1) -> Trace:
    """``trace`` with every chunk's token count times ``scale`` (rounded, at least ``minimum``): the
    same agent at a size a tiny model or a CPU runs in seconds. Queries keep their sizes."""
    events = [ev.model_copy(update={"tokens": max(int(minimum), int(round(ev.tokens * scale)))}) if ev.op == "arrive" else ev
              for ev in trace.events]
    out = Trace(header=trace.header, events=events, path=trace.path)
    out.chunks = check_trace(out)
    return out


def dumps_event(ev: Event | TraceHeader) -> str:
    """One line of JSON (defaults and Nones left out: compact and stable)."""
    return ev.model_dump_json(exclude_none=True, exclude_defaults=False)


def write_trace(path: str | os.PathLike, header: TraceHeader, events: Iterable[Event]) -> Path:
    """Write a trace atomically (temp file + rename); ``.gz`` / ``.xz`` suffixes compress."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with open(tmp, "wb") as raw:
            if p.suffix == ".gz":  # mtime=0, no name: byte-identical output for identical traces
                sink: IO[bytes] = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0)
            elif p.suffix == ".xz":
                sink = lzma.LZMAFile(raw, "wb")
            else:
                sink = raw
            with io.TextIOWrapper(sink, encoding="utf-8", newline="\n") as f:
                f.write(dumps_event(header) + "\n")
                for ev in events:
                    f.write(dumps_event(ev) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a trace is an ordinary file
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p


def trace_from_events(header: TraceHeader, events: Sequence[Event], *, name: str | None = None) -> Trace:
    """A validated in-memory trace (same checks as :func:`read_trace`)."""
    t = Trace(header=header, events=list(events), path=name)
    t.chunks = check_trace(t)
    return t
