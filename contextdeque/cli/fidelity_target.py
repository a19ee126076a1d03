"""The fidelity-target options every command that builds windows takes (``serve``, ``replay
--fidelity``, ``fidelity``), in one place: ``--fidelity-target``, ``--max-patch-fraction`` and
``--on-miss`` (docs/fidelity.md, "The fidelity target")."""

from __future__ import annotations

import argparse
from typing import Any

from ..patch.alloc import DEFAULT_ON_MISS, ON_MISS


def fraction(text: str) -> float:
    """A value in (0, 1] (a byte cap over the page, an η target)."""
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < val <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a value in (0, 1], got {text!r}")
    return val


def targets(text: str) -> tuple[float, ...]:
    """Comma-separated η targets in (0, 1]."""
    vals = tuple(fraction(x) for x in text.split(",") if x.strip())
    if not vals:
        raise argparse.ArgumentTypeError(f"expected at least one target, got {text!r}")
    return vals


def add_fidelity_target_arguments(parser: argparse.ArgumentParser, target_help: str, *, several: bool = False) -> None:
    """``--fidelity-target`` (one η, or with ``several`` a comma-separated list), ``--max-patch-fraction``
    and ``--on-miss``."""
    parser.add_argument("--fidelity-target", type=targets if several else fraction, default=() if several else None,
                        metavar="T[,T...]" if several else "T", help=target_help)
    parser.add_argument("--max-patch-fraction", type=fraction, default=0.25,
                        help="the fidelity target's byte cap: patch bytes over page bytes (default 0.25)")
    parser.add_argument("--on-miss", choices=ON_MISS, default=DEFAULT_ON_MISS,
                        help=f"what a patch the cap cannot fit the target into does (default {DEFAULT_ON_MISS}): report "
                             f"the miss, exceed_budget, or recompute (the exact conditioning)")


def window_options(args: argparse.Namespace) -> dict[str, Any]:
    """``ContextWindow`` settings from the options (none without a single ``--fidelity-target``)."""
    if args.fidelity_target is None:
        return {}
    return dict(fidelity_target=args.fidelity_target, max_patch_fraction=args.max_patch_fraction, on_miss=args.on_miss)
