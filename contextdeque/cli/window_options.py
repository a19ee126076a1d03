"""The window options of every command that builds windows, in one place, and the one
:class:`~contextdeque.window.WindowConfig` they name (the way ``model_spec`` holds ``--threads``).

:func:`add_window_arguments` adds ``--patch-policy`` (also spelled ``--policy``) and ``--rank``;
:func:`add_fidelity_target_arguments` adds ``--fidelity-target``, ``--max-patch-fraction`` and
``--on-miss`` (docs/fidelity.md, "The fidelity target"); :func:`window_config` builds the settings
from them, validated once (a bad rank or an unknown policy is a ``WindowError``: one line, exit 2).
"""

from __future__ import annotations

import argparse
from typing import Any

from ..patch.alloc import DEFAULT_ON_MISS, ON_MISS
from ..patch.rank import DEFAULT_RANK

POLICY_HELP = ("patch policy: default (= latency: re-reads run no forward, healed in idle time), eager, exact, none, "
               "or another registered name")


def fraction(text: str) -> float:
    """A value in (0, 1] (a byte cap over the page, an η target)."""
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < val <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a value in (0, 1], got {text!r}")
    return val


def precisions(text: str) -> tuple[str, ...]:
    """``--patch-precisions``: comma-separated names of ``contextdeque.patch.factors.PRECISIONS``."""
    from ..patch.factors import check_precisions

    try:
        return check_precisions([p.strip() for p in text.split(",") if p.strip()])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def targets(text: str) -> tuple[float, ...]:
    """Comma-separated η targets in (0, 1]."""
    vals = tuple(fraction(x) for x in text.split(",") if x.strip())
    if not vals:
        raise argparse.ArgumentTypeError(f"expected at least one target, got {text!r}")
    return vals


def add_window_arguments(parser: argparse.ArgumentParser, *, policy: str | None = "default",
                         policy_help: str = POLICY_HELP, with_policy: bool = True, rank: int | None = DEFAULT_RANK,
                         rank_help: str = "patch rank m") -> None:
    """``--patch-policy`` / ``--policy`` (default ``policy``; None: the settings' own default, which
    ``policy_help`` names; ``with_policy=False``: the command takes no policy) and ``--rank``
    (default ``rank``: :data:`DEFAULT_RANK` unless the command says otherwise)."""
    if with_policy:
        parser.add_argument("--patch-policy", "--policy", dest="patch_policy", default=policy, metavar="POLICY",
                            help=policy_help if policy is None else f"{policy_help} (default: {policy})")
    parser.add_argument("--rank", type=int, default=rank, help=rank_help if rank is None else f"{rank_help} (default: {rank})")


def add_bench_arguments(parser: argparse.ArgumentParser, *, runs: int, runs_help: str, chunks: int, chunks_help: str,
                        chunk_tokens: int) -> None:
    """The window benches' shared options: ``--json``, ``--runs``, ``--chunks``, ``--chunk-tokens``
    and the window options (:func:`add_window_arguments`)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--runs", type=int, default=runs, help=runs_help)
    parser.add_argument("--chunks", type=int, default=chunks, help=chunks_help)
    parser.add_argument("--chunk-tokens", type=int, default=chunk_tokens, help="tokens per chunk")
    add_window_arguments(parser)


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
    parser.add_argument("--patch-precisions", type=precisions, default=None, metavar="P[,P...]",
                        help="storage precisions the target's allocation may give a kept direction (default "
                             "hi,bf16,int8,int4: bytes allocated, not only rank; hi alone: the page's dtype, rank only; "
                             "docs/fidelity.md)")


def window_options(args: argparse.Namespace) -> dict[str, Any]:
    """The fidelity-target settings the options name (none without a single ``--fidelity-target``)."""
    if getattr(args, "fidelity_target", None) is None:
        return {}
    named = dict(fidelity_target=args.fidelity_target, max_patch_fraction=args.max_patch_fraction, on_miss=args.on_miss)
    if getattr(args, "patch_precisions", None) is not None:
        named["patch_precisions"] = tuple(args.patch_precisions)
    return named


def named_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The window settings the command line named: patch policy, rank, the fidelity target."""
    named = window_options(args)
    for option in ("patch_policy", "rank"):
        if getattr(args, option, None) is not None:
            named[option] = getattr(args, option)
    return named


def window_config(args: argparse.Namespace, **defaults: Any) -> Any:
    """The :class:`~contextdeque.window.WindowConfig` the options name, over the command's own
    ``defaults`` (e.g. ``budget_tokens=``, ``overflow=``); validated once, here."""
    from ..window.config import WindowConfig

    return WindowConfig(**{**defaults, **named_settings(args)})
