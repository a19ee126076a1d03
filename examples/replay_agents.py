"""Generate traces for the three agent kinds, replay them under placement x eviction x reuse-arm
policies with the cost model, print the table and write a plot.

Each agent kind gets a seeded trace (web: a sliding window of pages over a growing transcript with
revisits; video: segments re-examined under changing prompts with look-backs and comparison
reorders; document: coarse-to-fine over pages with re-access after filtering). The replay runs
them in parallel and is deterministic: the same seed gives byte-identical JSON.

Run:  .venv/bin/python examples/replay_agents.py [OUT_DIR] [--fidelity N]

``--fidelity N`` also drives a real ContextWindow on the default model (minutes on a CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

from contextdeque.cli import main as cli


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv and not argv[0].startswith("--") else Path("replay-example")
    rest = [a for a in argv if a.startswith("--") or a.isdigit()]
    for kind in ("web", "video", "doc"):
        if cli(["traces", "generate", "--kind", kind, "--n", "1", "--seed", "0", str(out / "traces")]) != 0:
            return 1
    traces = sorted(str(p) for p in (out / "traces").glob("*.jsonl"))
    args = ["replay", *traces, "--placement", "arrival,scheduler", "--eviction", "lru",
            "--arm", "patch,prefix_cache,reprefill", "--plot", str(out / "replay.png"), *rest]
    code = cli(args)
    if code == 0:
        print(f"plot: {out / 'replay.png'}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
