"""Traces: format round trip, whole-trace validation with line + field, generators, Mooncake import."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest

from contextdeque.core.errors import TraceError, TraceVersionError, UnknownChunkError
from contextdeque.traces import (
    FORMAT_VERSION,
    Arrive,
    TraceHeader,
    generate,
    import_mooncake,
    read_trace,
    write_trace,
)


def _write_lines(path, lines):
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    return path


HEADER = {"format": "contextdeque-trace", "version": 1, "generator": "test"}


@pytest.mark.parametrize("kind", ["web", "video", "doc"])
def test_generators_are_seeded_valid_and_realistic(kind, tmp_path):
    a, b, c = generate(kind, seed=1), generate(kind, seed=1), generate(kind, seed=2)
    assert a.events == b.events and a.events != c.events
    ops = Counter(e.op for e in a.events)
    assert ops["arrive"] >= 10 and ops["query"] >= 5 and (ops["evict"] + ops["slide"]) >= 5
    assert ops["recall"] >= 1  # look-backs / revisits / re-access
    big = [e.tokens for e in a.events if isinstance(e, Arrive) and e.modality in ("image", "frame")]
    assert big and min(big) >= 100 and max(big) >= 256  # screenshots / frames are hundreds+ of tokens
    p = write_trace(tmp_path / f"{kind}.jsonl", a.header, a.events)
    assert read_trace(p).events == a.events
    q = write_trace(tmp_path / f"{kind}.jsonl.gz", a.header, a.events)
    q2 = write_trace(tmp_path / f"again-{kind}.jsonl.gz", a.header, a.events)
    assert q.read_bytes() == q2.read_bytes()  # deterministic bytes, compressed too
    assert read_trace(q).events == a.events


def test_video_has_comparison_reorders_and_web_has_forks():
    ops_v = Counter(e.op for s in range(4) for e in generate("video", seed=s).events)
    ops_w = Counter(e.op for s in range(4) for e in generate("web", seed=s).events)
    assert ops_v["reorder"] >= 1
    assert ops_w["fork"] >= 1 and ops_w["fork"] == ops_w["commit"] + ops_w["discard"]


def test_malformed_line_reports_line_and_field(tmp_path):
    p = _write_lines(tmp_path / "t.jsonl", [HEADER, {"op": "arrive", "id": "a", "tokens": 10, "hash": "h"},
                                            {"op": "arrive", "id": "b", "tokens": -3, "hash": "h2"}])
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert e.value.line == 3 and e.value.field == "tokens" and ":3" in str(e.value)
    p = _write_lines(tmp_path / "u.jsonl", [HEADER, "{not json"])
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert e.value.line == 2
    p = _write_lines(tmp_path / "v.jsonl", [HEADER, {"op": "teleport", "id": "a"}])
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert e.value.line == 2 and e.value.field == "op"
    p = _write_lines(tmp_path / "w.jsonl", [HEADER, {"op": "query", "tokens": 3, "colour": "red"}])
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert e.value.field == "colour"
    assert isinstance(e.value, ValueError)


def test_unknown_chunk_is_typed_with_location(tmp_path):
    p = _write_lines(tmp_path / "t.jsonl", [HEADER, {"op": "arrive", "id": "a", "tokens": 10, "hash": "h"},
                                            {"op": "query"}, {"op": "recall", "id": "ghost"}])
    with pytest.raises(UnknownChunkError) as e:
        read_trace(p)
    assert e.value.line == 4 and e.value.field == "id" and "ghost" in str(e.value)
    p = _write_lines(tmp_path / "r.jsonl", [HEADER, {"op": "arrive", "id": "a", "tokens": 10, "hash": "h"},
                                            {"op": "reorder", "order": ["a", "b"]}])
    with pytest.raises(UnknownChunkError):
        read_trace(p)
    p = _write_lines(tmp_path / "s.jsonl", [HEADER, {"op": "arrive", "id": "a", "tokens": 10, "hash": "h"}, {"op": "slide", "n": 2}])
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert e.value.field == "n"
    p = _write_lines(tmp_path / "c.jsonl", [HEADER, {"op": "commit"}])
    with pytest.raises(TraceError):
        read_trace(p)


def test_newer_version_refused(tmp_path):
    p = _write_lines(tmp_path / "t.jsonl", [{**HEADER, "version": FORMAT_VERSION + 1}, {"op": "query"}])
    with pytest.raises(TraceVersionError) as e:
        read_trace(p)
    assert e.value.line == 1 and e.value.field == "version"
    p = _write_lines(tmp_path / "n.jsonl", [{"op": "query"}])
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert e.value.line == 1


def test_discard_restores_membership(tmp_path):
    p = _write_lines(tmp_path / "t.jsonl", [HEADER, {"op": "arrive", "id": "a", "tokens": 10, "hash": "h"}, {"op": "fork"},
                                            {"op": "evict", "id": "a"}, {"op": "discard"}, {"op": "evict", "id": "a"}])
    assert len(read_trace(p).events) == 5
    p = _write_lines(tmp_path / "u.jsonl", [HEADER, {"op": "arrive", "id": "a", "tokens": 10, "hash": "h"}, {"op": "fork"},
                                            {"op": "evict", "id": "a"}, {"op": "commit"}, {"op": "evict", "id": "a"}])
    with pytest.raises(UnknownChunkError):
        read_trace(p)


def _mooncake_lines():
    # The format of the public FAST'25 traces (written here, not copied from them).
    return [
        {"timestamp": 0, "input_length": 1100, "output_length": 50, "hash_ids": [0, 1, 2]},
        {"timestamp": 10, "input_length": 1300, "output_length": 20, "hash_ids": [0, 1, 3]},
        {"timestamp": 25, "input_length": 600, "output_length": 7, "hash_ids": [0, 4]},
        {"timestamp": 40, "input_length": 1536, "output_length": 9, "hash_ids": [0, 1, 2]},
    ]


def test_mooncake_import(tmp_path):
    src = tmp_path / "mc.jsonl.gz"
    with gzip.open(src, "wt") as f:
        for x in _mooncake_lines():
            f.write(json.dumps(x) + "\n")
    t = import_mooncake(src)
    assert t.header.meta["requests"] == 4 and t.header.meta["unique_blocks"] == 5
    assert t.header.meta["size_mismatches"] == 1  # block 2 closes request 1 (76) and is full in request 4
    arrivals = {e.id: e.tokens for e in t.events if e.op == "arrive"}
    assert arrivals == {"b0": 512, "b1": 512, "b2": 76, "b3": 276, "b4": 88}
    ops = [e.op for e in t.events]
    assert ops.count("step") == 4 and ops.count("query") == 4
    assert [e.id for e in t.events if e.op == "recall"] == ["b1", "b2"]
    out = write_trace(tmp_path / "conv.jsonl", t.header, t.events)
    assert read_trace(out).events == t.events
    assert import_mooncake(src, limit=2).header.meta["requests"] == 2


def test_mooncake_bad_request_has_location(tmp_path):
    lines = _mooncake_lines()
    lines[2] = {"timestamp": 25, "input_length": 600, "output_length": 7, "hash_ids": "x"}
    src = _write_lines(tmp_path / "mc.jsonl", lines)
    with pytest.raises(TraceError) as e:
        import_mooncake(src)
    assert e.value.line == 3 and e.value.field == "hash_ids"
    lines[2] = {"timestamp": 25, "input_length": 9000, "output_length": 7, "hash_ids": [0, 4]}
    with pytest.raises(TraceError) as e:
        import_mooncake(_write_lines(tmp_path / "mc2.jsonl", lines))
    assert e.value.field == "input_length"


def test_cli_generate_import_validate(tmp_path, capsys):
    from contextdeque.cli import main

    assert main(["traces", "generate", "--kind", "doc", "--n", "2", "--seed", "5", str(tmp_path / "g")]) == 0
    files = sorted((tmp_path / "g").glob("*.jsonl"))
    assert [f.name for f in files] == ["doc-5.jsonl", "doc-6.jsonl"]
    src = _write_lines(tmp_path / "mc.jsonl", _mooncake_lines())
    assert main(["traces", "import", "mooncake", str(src), str(tmp_path / "mc-conv.jsonl")]) == 0
    assert main(["traces", "validate", *map(str, files), str(tmp_path / "mc-conv.jsonl")]) == 0
    bad = _write_lines(tmp_path / "bad.jsonl", [HEADER, {"op": "evict", "id": "nope"}])
    assert main(["traces", "validate", str(bad)]) == 1
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_header_model():
    h = TraceHeader(generator="x")
    assert h.version == FORMAT_VERSION and h.format == "contextdeque-trace"


def test_expect_names_a_chunk_or_an_order(tmp_path):
    """An ``expect`` hint names a chunk to recall or the order the agent will reorder the window to
    after its recalls, never both; an order names chunks that arrived, each once. The doc and video
    generators announce every reorder that follows a re-access so (the window it names is the one
    the reorder then asks for)."""
    from pydantic import ValidationError

    from contextdeque.traces import Expect

    with pytest.raises(ValidationError):
        Expect(id="a", order=["a"])
    with pytest.raises(ValidationError):
        Expect()
    with pytest.raises(ValidationError):
        Expect(order=["a"], at=0)
    arrive = {"op": "arrive", "id": "a", "tokens": 3, "hash": "h"}
    ok = _write_lines(tmp_path / "ok.jsonl", [HEADER, arrive, {"op": "expect", "order": ["a"]}])
    assert read_trace(ok).events[-1].order == ["a"]
    bad = _write_lines(tmp_path / "ghost.jsonl", [HEADER, arrive, {"op": "expect", "order": ["a", "ghost"]}])
    with pytest.raises(UnknownChunkError) as err:
        read_trace(bad)
    assert err.value.line == 3 and err.value.field == "order"
    twice = _write_lines(tmp_path / "twice.jsonl", [HEADER, arrive, {"op": "expect", "order": ["a", "a"]}])
    with pytest.raises(TraceError, match="once"):
        read_trace(twice)
    for kind in ("doc", "video"):
        events = generate(kind, seed=0).events
        hinted = [i for i, e in enumerate(events) if e.op == "expect" and e.order is not None]
        assert hinted
        for i in hinted:  # the next reorder is the one announced, after the step's recalls
            nxt = next(e for e in events[i + 1:] if e.op in ("reorder", "arrive", "evict", "slide"))
            assert nxt.op == "reorder" and nxt.order == events[i].order
