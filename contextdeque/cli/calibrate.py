"""``contextdeque calibrate``: measure the replay cost model on this machine's backend
(``contextdeque.replay.calibrate``) and save it; with ``--envelope``, also the model's fidelity
envelope (how a patch's captured energy maps to η, ``contextdeque.eval.fidelity.envelope``),
cached beside the layout proofs and keyed by the weights' fingerprint, which a window's
``fidelity_target`` reads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..replay.calibrate import DEFAULT_FORM_LENGTHS, calibrate
from ..scheduler.cost_model import save_calibration
from .model_spec import MODEL_HELP, add_threads_argument, load_backend
from .window_options import add_window_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    add_threads_argument(parser)
    add_window_arguments(parser, with_policy=False)
    parser.add_argument("--cache-dir", type=Path, default=None, help="the cost model's cache root (default: $CONTEXTDEQUE_CACHE or ~/.cache/contextdeque; "
                        "the envelope is cached under $CONTEXTDEQUE_CACHE)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="where the model runs while its speeds are measured: cpu or cuda "
                        "(default cpu; host and disk bandwidths are the host's either way)")
    parser.add_argument("--lengths", default="64,256,1024", metavar="N[,N...]",
                        help="chunk lengths whose prefill speed is measured (default 64,256,1024; a GPU's rate keeps "
                             "rising past 1,024 tokens: add 2048,4096 there)")
    parser.add_argument("--form-lengths", default=",".join(map(str, DEFAULT_FORM_LENGTHS)), metavar="N,N[,N...]",
                        help="chunk lengths whose forming overhead (form_patch less its conditioned forward) is measured "
                             "and split into a fixed part per patch and a per-token part (default "
                             f"{','.join(map(str, DEFAULT_FORM_LENGTHS))}; two or more)")
    parser.add_argument("--envelope", action="store_true",
                        help="also measure the model's fidelity envelope (energy -> η on a few probe items; minutes "
                             "on a CPU) and cache it beside the layout proofs, measured afresh even when cached")
    parser.add_argument("--only-envelope", action="store_true", help="the fidelity envelope only (no cost model)")
    parser.add_argument("--sensitivity", action="store_true",
                        help="the envelope also measures per-layer K/V sensitivities and weighs the allocation by them "
                             "(opt-in: measured worse than equal weights on SmolLM2 and Gemma 3, docs/fidelity.md)")
    parser.add_argument("--max-chunk-tokens", type=int, default=512, help="the envelope's probe chunks are cut to this (test models)")
    parser.add_argument("--image-grid", default=None, metavar="RxC", help="the envelope's image spans' grid (test models)")


def print_envelope(env: Any, out: Any = print) -> None:
    """The envelope as a few lines: where it came from, and the energy and η per calibration point."""
    from ..model.envelope import envelope_path

    out(f"fidelity envelope of {env.model or env.fingerprint[:12]}: {env.summary()}")
    out(f"  cached at {envelope_path(env.fingerprint)}; measured in {env.seconds:.0f} s "
        f"({env.sensitivity_seconds:.0f} s of it the per-layer sensitivities)")
    out(f"  energy    median η   p10 η   map η (q{env.quantile:g})   bytes/page")
    for e, m, p, q, b in zip(env.energies, env.median_eta, env.p10_eta, env.map_eta(), env.mean_bytes_fraction):
        out(f"  {e:<8g}  {m:>8.4f}  {p:>6.4f}  {q:>13.4f}  {b:>10.3f}")
    if env.sensitivity_k:
        def row(xs: Any) -> str:
            return " ".join(f"{x:.2g}" for x in xs)

        out(f"  sensitivity per layer, K: {row(env.sensitivity_k)}")
        out(f"  sensitivity per layer, V: {row(env.sensitivity_v)}")


def run(args: argparse.Namespace) -> int:
    if args.sensitivity and not (args.envelope or args.only_envelope):
        print("contextdeque calibrate: --sensitivity is part of the fidelity envelope: give --envelope or --only-envelope",
              file=sys.stderr)
        return 2
    # a model that cannot be loaded, a cache directory that cannot be written or a model with
    # nothing to calibrate η on: one line, exit 2 (contextdeque.cli.main)
    lengths, form_lengths = _lengths(args.lengths), _lengths(args.form_lengths, "--form-lengths", at_least=2)
    backend = load_backend(args.model, threads=args.threads, device=args.device)
    if not args.only_envelope:
        model = calibrate(backend, lengths=lengths, rank=args.rank, repeats=args.repeats, form_lengths=form_lengths)
        path = save_calibration(model, args.cache_dir)
        print(f"calibration saved to {path}")
        for k, v in model.to_json().items():
            if k != "extra":
                print(f"  {k}: {v}")
        print(form_split_line(model))
        print(forward_fixed_line(model))
    if args.envelope or args.only_envelope:
        from ..eval.fidelity.envelope import ensure_envelope

        grid = None if not args.image_grid else tuple(int(x) for x in args.image_grid.lower().split("x"))
        print_envelope(ensure_envelope(backend, refresh=True, max_chunk_tokens=args.max_chunk_tokens, image_grid=grid,
                                       sensitivity=args.sensitivity))
    return 0


def form_split_line(model: Any) -> str:
    """One line: the forming overhead per patch and per token, the measured points, and what the
    fit gives at the traces' median chunk lengths."""
    points = model.extra.get("form_overhead_s", [])
    measured = ", ".join(f"{int(t)}: {s * 1e3:.2f} ms" for t, s in points)
    at = ", ".join(f"{t}: {model.factorize_s(t) * 1e3:.2f} ms" for t in (324, 512, 866))
    return (f"  forming beyond its forward: {model.form_fixed_s * 1e3:.3f} ms per patch + "
            f"{model.svd_s_per_token * 1e6:.3f} us per token (measured by chunk length: {measured}; "
            f"the fit at the traces' median chunk lengths: {at})")


def forward_fixed_line(model: Any) -> str:
    """One line: a forward's fixed part, the measured prefill times it was fitted to, and what it
    changes for the issue's case (a 512-token forward behind 1,536 cached tokens)."""
    measured = ", ".join(f"{int(n)}: {n / rate * 1e3:.1f} ms" for n, (_, rate) in
                         zip(model.extra.get("lengths", []), model.extra.get("prefill_measured", [])))
    rate_alone = 512 / model.tokens_per_s(2048)
    return (f"  a forward's fixed part: {model.forward_fixed_s * 1e3:.3f} ms (the intercept of the prefill times by "
            f"tokens: {measured or 'not kept'}); a 512-token forward behind 1,536 tokens: "
            f"{model.prefill_s(512, 1536) * 1e3:.2f} ms (the rate alone: {rate_alone * 1e3:.2f} ms)")


def _lengths(spec: str, option: str = "--lengths", at_least: int = 1) -> tuple[int, ...]:
    """``--lengths`` (``option``): ``at_least`` positive token counts, comma-separated, in increasing order."""
    from ..core.errors import ArgumentError

    try:
        lengths = tuple(int(x) for x in spec.split(","))
    except ValueError:
        lengths = ()
    if len(lengths) < at_least or min(lengths) < 1 or list(lengths) != sorted(set(lengths)):
        raise ArgumentError(f"{option}: expected {at_least} or more increasing positive token counts such as 64,256,1024, "
                            f"got {spec!r}")
    return lengths
