"""``contextdeque verify-model``: the per-model exactness gate (``contextdeque.eval.verify``) on the
command line: a table, or one JSON object with ``--json``; exit 1 when the gate fails."""

from __future__ import annotations

import argparse
import json

from ..core.errors import ContextDequeError
from ..eval.verify import DEFAULT_OFFSETS, verify_backend
from .model_spec import MODEL_HELP, load_backend


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    p.add_argument("--offsets", default=",".join(map(str, DEFAULT_OFFSETS)), help="comma-separated position offsets")
    p.add_argument("--tokens", type=int, default=96, help="tokens of real text to encode")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        backend = load_backend(args.model)
        report = verify_backend(backend, [int(x) for x in args.offsets.split(",") if x], args.tokens, backend.name)
    except ContextDequeError as exc:
        if args.json:
            print(json.dumps({"model": args.model or "default", "ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        else:
            print(f"refused: {type(exc).__name__}: {exc}")
        return 1
    if args.json:
        print(json.dumps(report.to_json()))
        return 0 if report.ok else 1
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{report.model}[/]: {report.layout}")
    table = Table("chunk", "offset", "key rel err (fp32)", "noise floor", "bf16 key err (ULP)", "worst layer", "ok")
    for d in report.details:
        table.add_row(
            d.chunk, str(d.offset), f"{d.key_rel_err:.2e}", f"{d.noise_floor:.2e}", f"{d.bf16_ulp:.3f}", str(d.worst_layer),
            "[green]yes[/]" if d.ok else "[red]NO[/]",
        )
    console.print(table)
    for r in report.refused:
        console.print(f"[yellow]refused[/] {r}")
    console.print("[bold green]PASS[/]" if report.ok else "[bold red]FAIL[/]")
    return 0 if report.ok else 1
