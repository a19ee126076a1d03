"""``contextdeque verify-model``: the per-model exactness gate (``contextdeque.eval.verify``) on the
command line: a table, or one JSON object with ``--json``; exit 1 when the gate fails."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..core.errors import ContextDequeError, ModelLoadError
from ..eval.verify import DEFAULT_OFFSETS, verify_backend
from ..model.tiny_auto import TinyBuildError
from .model_spec import MODEL_HELP, add_threads_argument, load_backend


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    p.add_argument("--arch", default=None,
                   help="with --random: the same as MODEL tiny:ARCH (a contextdeque tiny arch or any model_type "
                        "of transformers' causal-LM mapping)")
    p.add_argument("--random", action="store_true", help="random weights (required with --arch)")
    p.add_argument("--offsets", default=",".join(map(str, DEFAULT_OFFSETS)), help="comma-separated position offsets")
    p.add_argument("--tokens", type=int, default=96, help="tokens of real text to encode")
    p.add_argument("--device", default="cpu", help="where the model and the kernels run: cpu or cuda (default cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--envelope", action="store_true",
                   help="calibrate the model's fidelity envelope when it is not cached (minutes on a CPU); "
                        "without it the cached envelope is reported, or its absence")
    add_threads_argument(p)


def _backend_from_args(args: argparse.Namespace) -> Any:
    spec = args.model
    if args.arch:
        if not args.random:
            raise SystemExit("--arch needs --random (no checkpoints are fetched)")
        spec = f"tiny:{args.arch}"
    try:
        # verify-model runs the full gate itself: the shorter proof at load would only repeat it
        return load_backend(spec, verify_at_load=False, device=args.device, threads=args.threads)
    except KeyError:
        raise SystemExit(f"unknown tiny arch {spec!r}: not a tiny arch nor a causal-LM model_type") from None
    except TinyBuildError as exc:
        raise SystemExit(f"{spec}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    try:
        backend = _backend_from_args(args)
        report = verify_backend(backend, [int(x) for x in args.offsets.split(",") if x], args.tokens, backend.name)
    except ModelLoadError:
        raise  # no model to judge: a user error (one line, exit 2), not the gate's verdict
    except ContextDequeError as exc:
        reason = getattr(exc, "reason", None)
        error = f"{type(exc).__name__}" + (f" ({reason})" if reason else "") + f": {exc}"
        if args.json:
            print(json.dumps({"model": args.model or args.arch or "default", "ok": False, "reason": reason, "error": error}))
        else:
            print(f"refused: {error}")
        return 1
    env, env_note = _envelope(backend, args.envelope and report.ok)
    if args.json:
        print(json.dumps({**report.to_json(), "fidelity_envelope": None if env is None else env.as_dict(),
                          "fidelity_envelope_note": env_note}))
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
    if env is not None:
        from .calibrate import print_envelope

        print_envelope(env, console.print)
    else:
        console.print(env_note)
    console.print("[bold green]PASS[/]" if report.ok else "[bold red]FAIL[/]")
    return 0 if report.ok else 1


def _envelope(backend: Any, measure: bool) -> tuple[Any, str]:
    """The model's fidelity envelope (cached, or measured now when ``measure``) and a note."""
    from ..model.envelope import load_envelope

    env = load_envelope(backend.fingerprint)
    if env is None and measure:
        from ..eval.fidelity.envelope import ensure_envelope

        try:
            env = ensure_envelope(backend)
        except ContextDequeError as exc:
            return None, f"fidelity envelope: not calibrated ({exc})"
    if env is None:
        return None, ("fidelity envelope: not calibrated (a fidelity_target is read as an energy); run "
                      "`contextdeque calibrate --only-envelope --model ...` or pass --envelope")
    return env, "cached" if env.cached else "measured"
