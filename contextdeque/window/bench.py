"""``contextdeque window-bench``: what a slide and a fork cost on a 4x512-token window.

Builds a window of ``--chunks`` chunks of ``--chunk-tokens`` tokens of real text (Python's own
documentation, ``pydoc_data.topics``) on the default model, then measures (median of
``--runs``):

- ``slide``: ``slide(1)`` on the full window (survivors re-rotated from their content frame,
  nothing re-encoded; each run slides a fresh fork so every run sees the full window);
- ``fork``: ``fork()`` of the full window;
- ``fork_bytes_copied``: tensor bytes the child holds that the parent does not share (goal:
  0), and the same after the child diverges with one ``slide(1)``;
- for scale: ``materialize`` and one re-prefill forward of the same window.

Prints measured numbers (``--json`` for a machine-readable record); it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--runs", type=int, default=7, help="timed runs per measurement (median reported)")
    parser.add_argument("--chunks", type=int, default=4, help="chunks in the window")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="tokens per chunk")
    parser.add_argument("--policy", default="default", help="patch policy (default, exact, none)")
    parser.add_argument("--rank", type=int, default=32, help="patch rank m")
    parser.add_argument(
        "--model", default=None,
        help="a local model path; default: the embedded default model; 'tiny' for a tiny random llama",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def _backend(model: str | None) -> Any:
    import contextdeque as cd

    if model == "tiny":
        from transformers import LlamaConfig, LlamaForCausalLM

        from ..backends.hf import HFBackend

        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            m = LlamaForCausalLM(cfg).eval()
        return HFBackend(m, None, root_ids=[1, 2], name="tiny-bench-llama")
    return cd.load_model(model)


def _chunks(backend: Any, n: int, size: int) -> list[list[int]]:
    """``n`` chunks of ``size`` token ids of real documentation text (ids folded into the
    vocabulary for a tokenizer-less model)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    if backend.tokenizer is not None:
        ids = backend.tokenize(text[: 12 * n * size])
    else:
        vocab = int(backend.model.config.vocab_size)
        ids = [3 + b % (vocab - 3) for b in text.encode()]
    if len(ids) < n * size:
        raise SystemExit(f"not enough text for {n} x {size} tokens")
    return [ids[i * size : (i + 1) * size] for i in range(n)]


def _page_storage(win: Any) -> dict[int, int]:
    """data_ptr -> bytes of every page tensor the window holds."""
    out: dict[int, int] = {}
    for ref in win.refs:
        for k, v in win.kv(ref):
            for t in (k, v):
                out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return out


def _unshared_bytes(child: Any, parent: Any) -> int:
    mine, theirs = _page_storage(child), _page_storage(parent)
    return sum(n for ptr, n in mine.items() if ptr not in theirs)


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000.0, 3)


def run(args: argparse.Namespace) -> int:
    from .window import ContextWindow

    if args.threads:
        torch.set_num_threads(int(args.threads))
    backend = _backend(args.model)
    chunks = _chunks(backend, args.chunks, args.chunk_tokens)
    win = ContextWindow(backend, budget_tokens=args.chunks * args.chunk_tokens, rank=args.rank,
                        patch_policy=args.policy)
    t0 = time.perf_counter()
    appends = [win.append(token_ids=c).receipt for c in chunks]
    build_s = time.perf_counter() - t0

    slide_s, slide_receipts = [], []
    for _ in range(max(1, args.runs)):
        child = win.fork()
        t = time.perf_counter()
        r = child.slide(1)
        slide_s.append(time.perf_counter() - t)
        slide_receipts.append(r)
        child.discard()

    fork_s = []
    for _ in range(max(1, args.runs)):
        t = time.perf_counter()
        child = win.fork()
        fork_s.append(time.perf_counter() - t)
        child.discard()

    child = win.fork()
    fork_receipt = win.last_receipt
    copied_at_fork = _unshared_bytes(child, win)
    diverge = child.slide(1)
    copied_after_slide = _unshared_bytes(child, win)
    child.discard()

    mat_s = []
    for _ in range(max(1, args.runs)):
        t = time.perf_counter()
        win.materialize()
        mat_s.append(time.perf_counter() - t)

    ids = list(backend.root_ids) + [i for c in chunks for i in c]
    t = time.perf_counter()
    backend.forward(input_ids=ids, positions=backend.text_positions(0, len(ids)), logits="none")
    reprefill_s = time.perf_counter() - t

    last = slide_receipts[-1]
    result = {
        "model": backend.name,
        "device": str(backend.device),
        "threads": torch.get_num_threads(),
        "policy": args.policy,
        "rank": args.rank,
        "window": f"{args.chunks}x{args.chunk_tokens}",
        "runs": max(1, args.runs),
        "build_s": round(build_s, 3),
        "build_forwards": sum(r.forwards for r in appends),
        "slide_ms": _median_ms(slide_s),
        "slide_forwards": last.forwards,
        "slide_pages_written": last.pages_written,
        "slide_bytes_moved": last.bytes_moved,
        "fork_ms": _median_ms(fork_s),
        "fork_bytes_moved": fork_receipt.total_bytes_moved,
        "fork_bytes_copied": copied_at_fork,
        "fork_bytes_copied_after_child_slide": copied_after_slide,
        "child_slide_pages_bytes": diverge.bytes_moved.get("pages", 0),
        "materialize_ms": _median_ms(mat_s),
        "reprefill_ms": round(reprefill_s * 1000.0, 3),
    }
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    print(f"window-bench: {result['model']} on {result['device']} ({result['threads']} threads), "
          f"{result['window']} tokens, policy={args.policy}, rank={args.rank}, median of {result['runs']}")
    rows = [
        ("build (4 appends)", f"{result['build_s'] * 1000:.1f} ms", f"{result['build_forwards']} forwards"),
        ("slide(1)", f"{result['slide_ms']:.3f} ms",
         f"{result['slide_forwards']} forwards, {result['slide_pages_written']} pages re-placed"),
        ("fork()", f"{result['fork_ms']:.3f} ms",
         f"{result['fork_bytes_copied']} B copied, {result['fork_bytes_moved']} B moved"),
        ("child slide(1)", "", f"child then owns {result['fork_bytes_copied_after_child_slide']} B of its own pages"),
        ("materialize()", f"{result['materialize_ms']:.3f} ms", "fresh DynamicCache"),
        ("re-prefill (1 forward)", f"{result['reprefill_ms']:.1f} ms", "for scale"),
    ]
    w = max(len(r[0]) for r in rows)
    for name, val, note in rows:
        print(f"  {name:<{w}}  {val:>12}  {note}")
    sys.stdout.flush()
    return 0
