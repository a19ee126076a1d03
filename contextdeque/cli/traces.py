"""``contextdeque traces generate|import|validate``: make, convert and check agent traces."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..core.errors import ContextDequeError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="traces_command", metavar="ACTION", required=True)
    g = sub.add_parser("generate", help="seeded traces of one agent kind", description="seeded traces of one agent kind")
    g.add_argument("--kind", required=True, choices=["web", "video", "doc"])
    g.add_argument("--n", type=int, default=1, help="how many traces (seeds S .. S+N-1)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("out_dir", type=Path)
    i = sub.add_parser("import", help="convert a public trace into this format", description="convert a public trace into this format")
    i.add_argument("source", choices=["mooncake"])
    i.add_argument("file", type=Path, help="Mooncake FAST'25 JSONL (.jsonl, .gz or .xz)")
    i.add_argument("out", type=Path, help="the converted trace (.jsonl, .jsonl.gz or .jsonl.xz)")
    i.add_argument("--limit", type=int, default=None, help="convert only the first N requests")
    v = sub.add_parser("validate", help="check traces whole (exit 1 on the first error)", description="check traces whole")
    v.add_argument("traces", nargs="+", type=Path)


def run(args: argparse.Namespace) -> int:
    from ..traces.generators import generate
    from ..traces.io import read_trace, write_trace
    from ..traces.mooncake import import_mooncake

    try:
        if args.traces_command == "generate":
            if args.n < 1:
                print("error: --n must be >= 1", file=sys.stderr)
                return 2
            for s in range(args.seed, args.seed + args.n):
                t = generate(args.kind, seed=s)
                out = write_trace(args.out_dir / f"{args.kind}-{s}.jsonl", t.header, t.events)
                print(f"{out}: {len(t.events)} events, {len(t.chunks)} chunks")
        elif args.traces_command == "import":
            t = import_mooncake(args.file, limit=args.limit)
            out = write_trace(args.out, t.header, t.events)
            print(f"{out}: {len(t.events)} events; {json.dumps(t.header.meta, sort_keys=True)}")
        else:
            for p in args.traces:
                t = read_trace(p)
                print(f"{p}: ok ({len(t.events)} events, {len(t.chunks)} chunks, generator {t.header.generator})")
    except (ContextDequeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
