"""Torch thread counts side by side: window operations and ``serve`` TTFT per turn under each.

The measurement behind ``contextdeque.model.threads``' default (issue 26). Each thread setting
runs in its own process (torch's thread pool is per process and set once), one after another on
the same machine, so the figures are comparable within one run; the machine's load is printed
beside them, since on a shared machine it decides the answer::

    python -m contextdeque.eval.thread_bench --threads torch,1,2            # window operations
    python -m contextdeque.eval.thread_bench --threads torch,1,2 --serve    # and serve TTFT per turn

Window operations (:func:`run_window_ops`): ``append`` of ``pages`` pages of real text, ``heal``
(idle-time healing of what the latency-first policy skipped when they were reordered),
``generate`` of ``new_tokens`` tokens. ``serve``: ``contextdeque serve`` driven by ``contextdeque loadtest`` (one client, its
turns in sequence), TTFT per turn.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

from .window_bench import _chunks
from ..patch.rank import DEFAULT_RANK


def run_window_ops(backend: Any, *, pages: int = 4, page_tokens: int = 256, new_tokens: int = 16,
                   rank: int = DEFAULT_RANK) -> dict[str, Any]:
    """Seconds of each window operation on ``backend`` at the current torch thread count:
    ``append_s`` (all ``pages`` appends), ``heal_s``, ``generate_s`` (``new_tokens`` tokens),
    with the forwards each ran."""
    from ..window import ContextWindow

    win = ContextWindow(backend, budget_tokens=(pages + 2) * page_tokens + 256, rank=rank)
    append_s, append_forwards, refs = 0.0, 0, []
    for ids in _chunks(backend, pages, page_tokens):
        t0 = time.perf_counter()
        refs.append(win.append(token_ids=ids))
        append_s += time.perf_counter() - t0
        append_forwards += win.last_receipt.forwards
    win.reorder(refs[::-1])  # a re-read in another order: zero forwards now, its patches left to heal
    t0 = time.perf_counter()
    heal = win.heal()
    heal_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    query = "Summarize the first page in one sentence." if backend.tokenizer is not None else [5, 6, 7]
    answer = win.generate(query, max_new_tokens=new_tokens, chat=backend.tokenizer is not None)
    generate_s = time.perf_counter() - t0
    return {
        "threads": torch.get_num_threads(), "pages": pages, "page_tokens": page_tokens, "new_tokens": new_tokens,
        "append_s": append_s, "heal_s": heal_s, "generate_s": generate_s,
        "append_forwards": append_forwards, "heal_forwards": heal.forwards, "generated_tokens": len(answer.token_ids),
    }


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def _child(setting: str, model: str | None, pages: int, page_tokens: int, new_tokens: int) -> dict[str, Any]:
    """One setting's window operations in a fresh process; its JSON result."""
    code = ("import json,sys; from contextdeque.cli.model_spec import load_backend; "
            "from contextdeque.eval.thread_bench import run_window_ops; "
            f"b = load_backend({model!r}, threads={setting!r}); "
            f"print(json.dumps(run_window_ops(b, pages={pages}, page_tokens={page_tokens}, new_tokens={new_tokens})))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "CONTEXTDEQUE_THREADS")}
    load = _load()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "setting": setting, "load_before": load}


def _serve_child(setting: str, model: str | None, turns: int, max_tokens: int) -> dict[str, Any]:
    """``serve --threads setting`` driven by one ``loadtest`` client for ``turns`` turns."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "CONTEXTDEQUE_THREADS")}
    cmd = [sys.executable, "-m", "contextdeque.cli", "serve", "--port", "0", "--threads", setting, "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    load = _load()
    server = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        assert server.stderr is not None
        for line in server.stderr:
            if "listening on" in line:
                url = line.rsplit(" ", 1)[-1].strip()
                break
        if url is None:
            raise RuntimeError(f"serve --threads {setting} did not start")
        out = subprocess.run([sys.executable, "-m", "contextdeque.cli", "loadtest", "--url", url, "--clients", "1",
                              "--turns", str(turns), "--max-tokens", str(max_tokens), "--json"],
                             env=env, capture_output=True, text=True, check=True)
        rep = json.loads(out.stdout)
    finally:
        server.terminate()
        server.wait(timeout=60)
    return {"setting": setting, "load_before": load,
            "ttft_per_turn_s": [v["ttft_mean_s"] for _, v in sorted(rep["by_turn"].items(), key=lambda kv: int(kv[0]))]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m contextdeque.eval.thread_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="torch,1,2", help="settings, comma-separated: counts, auto, torch (its own)")
    ap.add_argument("--model", default=None, help="as every command's --model (default: the embedded default)")
    ap.add_argument("--pages", type=int, default=4)
    ap.add_argument("--page-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--serve", action="store_true", help="also serve TTFT per turn (loadtest, one client)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    settings = [s.strip() for s in args.threads.split(",") if s.strip()]
    rows = [_child(s, args.model, args.pages, args.page_tokens, args.new_tokens) for s in settings]
    served = [_serve_child(s, args.model, args.turns, args.new_tokens) for s in settings] if args.serve else []
    if args.json:
        print(json.dumps({"window": rows, "serve": served, "cores": len(os.sched_getaffinity(0))}))
        return 0
    print(f"thread-bench: {len(os.sched_getaffinity(0))} cores available; load averages before each run shown")
    base = rows[0]
    for r in rows:
        ratios = " ".join(f"{k[:-2]} x{r[k] / base[k]:.2f}" for k in ("append_s", "heal_s", "generate_s"))
        print(f"  --threads {r['setting']:>5} ({r['threads']} used, load {r['load_before']:.1f}): "
              f"append {r['append_s']:.2f} s, heal {r['heal_s']:.2f} s, generate {r['new_tokens']} "
              f"{r['generate_s']:.2f} s  [vs {base['setting']}: {ratios}]")
    for s in served:
        print(f"  serve --threads {s['setting']:>5} (load {s['load_before']:.1f}): TTFT per turn "
              + ", ".join(f"{t:.2f} s" for t in s["ttft_per_turn_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
