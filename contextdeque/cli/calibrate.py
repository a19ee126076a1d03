"""``contextdeque calibrate``: measure the replay cost model on this machine's backend
(``contextdeque.replay.calibrate``) and save it."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..replay.calibrate import calibrate
from ..replay.cost import save_calibration
from .model_spec import MODEL_HELP, add_threads_argument, load_backend


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    add_threads_argument(parser)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--cache-dir", type=Path, default=None, help="cache root (default: $CONTEXTDEQUE_CACHE or ~/.cache/contextdeque)")
    parser.add_argument("--repeats", type=int, default=2)


def run(args: argparse.Namespace) -> int:
    # a model that cannot be loaded or a cache directory that cannot be written: one line, exit 2
    # (contextdeque.cli.main)
    backend = load_backend(args.model, threads=args.threads)
    model = calibrate(backend, rank=args.rank, repeats=args.repeats)
    path = save_calibration(model, args.cache_dir)
    print(f"calibration saved to {path}")
    for k, v in model.to_json().items():
        if k != "extra":
            print(f"  {k}: {v}")
    return 0
