"""``contextdeque zoo``: the sweep over every causal-LM architecture of the installed transformers
(:mod:`contextdeque.model.zoo`): one line per architecture and the counts, or one JSON object."""

from __future__ import annotations

import argparse
import json

from .model_spec import add_threads_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_types", nargs="*", help="model types to sweep (default: all of the causal-LM mapping)")
    p.add_argument("--json", action="store_true", help="print one JSON object (counts and every verdict)")
    add_threads_argument(p)
    p.add_argument("--write-docs", metavar="REPO", default=None,
                   help="write REPO/docs/zoo.md and the counts in REPO/README.md (full sweep only)")


def run(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from ..model import zoo

    hf_logging.set_verbosity_error()
    from ..model.threads import choose_threads

    # tiny models: their size caps the automatic choice at one thread
    verdicts = zoo.sweep(args.model_types or None, threads=choose_threads(args.threads, model_params=1).threads)
    if args.json:
        print(json.dumps(zoo.to_json(verdicts)))
    else:
        for v in verdicts:
            detail = (v.layout if v.verdict in ("exact", "identity") else v.message).replace("\n", " ")
            err = f"{v.key_err:.1e}" if v.key_err is not None else ""
            print(f"{v.model_type:28s} {v.verdict:15s} {v.reason:18s} {err:8s} {detail[:140]}")
        print(json.dumps(zoo.counts(verdicts)))
    if args.write_docs:
        from pathlib import Path

        root = Path(args.write_docs)
        (root / "docs" / "zoo.md").write_text(zoo.render_markdown(verdicts))
        readme = root / "README.md"
        readme.write_text(zoo.update_readme(readme.read_text(), zoo.counts(verdicts)))
    bad = [v for v in verdicts if v.verdict in ("inexact", "error") or (v.verdict == "refused" and not v.reason_holds)]
    return 1 if bad else 0
