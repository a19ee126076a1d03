"""What the proof at load costs ``load_model()`` on the default model (issue 9).

One process: the default model and tokenizer are loaded once, then the backend over them is built
alternately with and without the proof, from an empty layout/proof cache (first load) and from a
warm disk cache with the in-memory caches cleared (a later process's load). Prints the median wall
and CPU seconds of each, the model forwards each ran, and the proof's overhead (with - without).

    OMP_NUM_THREADS=1 python examples/bench_proof_at_load.py [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from contextdeque.model import detect
from contextdeque.model.default_model import DEFAULT_MODEL_NAME, default_fingerprint, ensure_default_model
from contextdeque.model.hf import HFBackend
from contextdeque.model.load import load_hf_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    model, tok = load_hf_model(None)
    fp = default_fingerprint(ensure_default_model(progress=False), model)
    n = [0]
    model.register_forward_pre_hook(lambda m, a: n.__setitem__(0, n[0] + 1))
    real_dir = detect._proof_dir
    rows: dict[str, list[tuple[float, float, int]]] = {}

    def build(label: str, verify: bool, cache: Path, fresh: bool) -> None:
        detect._PROOFS.clear()  # in-memory caches cleared: only the disk cache (if any) remains
        detect._LAYOUTS.clear()
        if fresh:
            for f in cache.glob("*.json"):
                f.unlink()
        detect._proof_dir = lambda: cache
        n[0] = 0
        w, c = time.perf_counter(), time.process_time()
        HFBackend(model, tok, name=DEFAULT_MODEL_NAME, fingerprint=fp, verify_at_load=verify)
        rows.setdefault(label, []).append((time.perf_counter() - w, time.process_time() - c, n[0]))

    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        try:
            for _ in range(args.reps):
                build("first, with proof", True, Path(a), fresh=True)
                build("first, no proof", False, Path(b), fresh=True)
                build("cached, with proof", True, Path(a), fresh=False)
                build("cached, no proof", False, Path(b), fresh=False)
        finally:
            detect._proof_dir = real_dir
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v), v[0][2]) for k, v in rows.items()}
    for k, (w, c, f) in med.items():
        print(f"{k:20s} wall {w:6.3f} s  cpu {c:6.3f} s  model forwards {f}")
    for when in ("first", "cached"):
        (w1, c1, f1), (w0, c0, f0) = med[f"{when}, with proof"], med[f"{when}, no proof"]
        print(f"proof overhead, {when} load: wall {w1 - w0:+.3f} s, cpu {c1 - c0:+.3f} s, forwards {f1 - f0:+d}")


if __name__ == "__main__":
    main()
