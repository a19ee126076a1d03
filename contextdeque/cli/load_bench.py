"""``contextdeque load-bench``: ``contextdeque.eval.load_bench`` on the command line (a table, or
one JSON object with ``--json``): overlapped vs sequential tier loading of a window whose chunks
are half on disk, half missing."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..eval.load_bench import run_load_bench
from .model_spec import MODEL_HELP, add_threads_argument, load_backend
from .window_options import add_bench_arguments, fraction


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_arguments(parser, runs=3, runs_help="timed runs per mode (median reported)", chunks=8,
                        chunks_help="chunks in the window (half on disk, half missing)", chunk_tokens=256)
    parser.add_argument("--workers", type=int, default=1, help="background reader threads")
    parser.add_argument("--storage", default="float32", help="chunk storage dtype (float32, bfloat16)")
    parser.add_argument("--dir", default=None, help="disk tier directory (default: a temporary one)")
    parser.add_argument("--capsule", type=fraction, default=None, metavar="RHO",
                        help="keep the disk chunks compressed at rest (KVCapsule linear, mean retention RHO in (0, 1])")
    parser.add_argument(
        "--model", default=None,
        help=MODEL_HELP,
    )
    add_threads_argument(parser)


def run(args: argparse.Namespace) -> int:
    if args.chunks < 2:
        print("error: --chunks must be >= 2 (half on disk, half missing)", file=sys.stderr)
        return 2
    res = run_load_bench(load_backend(args.model, threads=args.threads), n_chunks=args.chunks, chunk_tokens=args.chunk_tokens, runs=args.runs,
                         policy=args.patch_policy, rank=args.rank, workers=args.workers, storage=args.storage,
                         disk_dir=args.dir, capsule=args.capsule)
    if args.json:
        sys.stdout.write(json.dumps(res, indent=1, default=str) + "\n")
        return 0
    seq, ovl = res["sequential"], res["overlapped"]
    print(f"model {res['model']}; {res['chunks']} chunks x {res['chunk_tokens']} tokens: {res['on_disk']} on disk "
          f"({res['disk_bytes'] / 2**20:.1f} MiB), {res['missing']} missing; policy {res['policy']} rank {res['rank']}; "
          f"{res['threads']} torch thread(s), {res['workers']} reader(s); median of {res['runs']} runs per mode")
    print(f"{'mode':<12}{'wall s':>9}{'load s':>9}{'compute s':>11}{'waited s':>10}{'fwd':>6}{'enc':>5}{'patches':>9}")
    for mode, r in (("sequential", seq), ("overlapped", ovl)):
        print(f"{mode:<12}{r['wall_s']:>9.3f}{r['load_s']:>9.3f}{r['compute_s']:>11.3f}{r['wait_s']:>10.3f}"
              f"{r['forwards']:>6}{r['encodes']:>5}{r['patches_formed']:>9}")
    print(f"speed-up of overlapped over sequential: {res['speedup']:.3f}x "
          f"(perfect overlap of these loads would give {res['ideal_speedup']:.3f}x)")
    print(f"windows identical bit for bit: {'yes' if res['identical'] else 'NO'}")
    cap = res.get("capsule")
    if cap:
        print(f"disk chunks compressed at rest (mean retention {cap['retention']}): {cap['stored_entry_bytes'] / 2**20:.2f} "
              f"MiB stored for {cap['uncompressed_entry_bytes'] / 2**20:.2f} MiB of entries (saved "
              f"{cap['bytes_saved_fraction']:.3f}; KV bytes saved {cap['kv_bytes_saved_fraction']:.3f}); basis "
              f"{cap['basis_bytes'] / 2**20:.2f} MiB fitted on {cap['calibration_chunks']} other chunks; reconstruction "
              f"error (relative Frobenius, max over chunks) K {max(cap['recon_error_k']):.4f} V {max(cap['recon_error_v']):.4f}")
    return 0
