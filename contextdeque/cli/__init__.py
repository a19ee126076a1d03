"""``contextdeque`` command line, the top layer. Each command is one module of this package
exposing ``add_arguments(parser)`` and ``run(args) -> int`` (exit code), listed in ``COMMANDS``
by module path: a command's module (and what it imports: torch, transformers, the server) is
imported only when that command is asked for, so ``contextdeque --help`` stays as light as the
standard library. The measurements themselves live in the layers below (``contextdeque.eval``,
``contextdeque.serve``). Every command names its model (``model_spec``) and its torch threads
(``model_spec.add_threads_argument``) the same way.

A user mistake never ends in a traceback: argparse errors, typed ``ContextDequeError`` s, a
missing optional extra and a missing input file are one line on stderr and exit status 2
(:data:`USAGE_EXIT`)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("contextdeque.cli.demo", "the main job: an agent answering questions through a window smaller than its material, vs re-prefill"),
    "verify-model": ("contextdeque.cli.verify_model", "exactness gate: relocation vs transformers' own forward, layer by layer"),
    "zoo": ("contextdeque.cli.zoo", "every causal-LM architecture of the installed transformers, tiny: exact / identity / refused (why) / could not build"),
    "fidelity": ("contextdeque.cli.fidelity", "every reuse arm vs a full re-prefill on the probe set"),
    "bench": ("contextdeque.cli.bench", "apply (relocate+patch) vs re-prefill and vs its roofline floor"),
    "window-bench": ("contextdeque.cli.window_bench", "slide and fork cost on a 4x512-token window"),
    "serve": ("contextdeque.cli.serve", "an OpenAI-compatible chat endpoint whose conversations are context windows [serve extra]"),
    "loadtest": ("contextdeque.cli.loadtest", "concurrent multi-turn agent conversations against serve replicas: throughput, latency, TTFT"),
    "load-bench": ("contextdeque.cli.load_bench", "overlapped vs sequential tier loading: a window half on disk, half missing"),
    "bench-vllm": ("contextdeque.cli.bench_vllm", "a re-read turn on vLLM: contextdeque's KV connector vs vLLM's prefix caching, side by side"),
    "store-bench": ("contextdeque.cli.store_bench", "Valkey store tier vs the local disk tier: put/get GB/s for one real chunk [serve extra]"),
    "traces": ("contextdeque.cli.traces", "generate agent traces (web/video/doc), import Mooncake traces, validate"),
    "replay": ("contextdeque.cli.replay", "replay traces under placement x eviction x reuse-arm policies (cost model, --fidelity)"),
    "replay-bench": ("contextdeque.cli.replay_bench", "replay throughput, scheduler vs arrival order, heuristic/exact, Mooncake under every policy"),
    "soak": ("contextdeque.cli.soak", "random window operations on the default (bounded) store: the resident-memory curve"),
    "calibrate": ("contextdeque.cli.calibrate", "measure the replay cost model on this machine's backend and save it"),
}

USAGE_EXIT = 2
"""Exit status of a user mistake (argparse's own for a bad command line)."""


def extra_for(module: str) -> str | None:
    """The optional extra (``pyproject``'s ``optional-dependencies``, read from the installed
    metadata) that installs the top-level ``module``; ``test`` only when no other extra has it."""
    import importlib.metadata as md
    import re

    try:
        requirements = md.requires("contextdeque") or []
    except md.PackageNotFoundError:
        return None
    extras = []
    for req in requirements:
        m = re.match(r"""\s*([A-Za-z0-9][A-Za-z0-9._-]*)[^;]*;.*extra\s*==\s*['"]([^'"]+)['"]""", req)
        if m and re.sub(r"[-.]+", "_", m.group(1)).lower() == module.lower():
            extras.append(m.group(2))
    return next((e for e in extras if e != "test"), extras[0] if extras else None)


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (what is wrong, and where the help is)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (and its options added): the others are
    listed by name and help alone."""
    parser = Parser(prog="contextdeque", description="position-free KV-cache chunks for agent context windows")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The command named on the command line (its first non-option word), if it is one."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def user_error_line(exc: BaseException) -> str | None:
    """One line saying what the user must change, for an exception that is a user's mistake
    (a typed contextdeque error, a missing optional extra, a missing or unreadable input file);
    None for anything else (a bug: its traceback is kept)."""
    from ..core.errors import ContextDequeError

    if isinstance(exc, ModuleNotFoundError) and exc.name:
        extra = extra_for(exc.name.split(".")[0])
        if extra:
            return (f"this needs the optional '{extra}' extra (missing module {exc.name}): "
                    f"pip install 'contextdeque[{extra}]'")
        return None
    if isinstance(exc, ContextDequeError):
        return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)) and exc.filename:
        return f"{type(exc).__name__}: {exc.strerror or exc}: {exc.filename}"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_of(argv)
    prog = f"contextdeque {command}" if command else "contextdeque"
    try:
        parser = build_parser(command)
        args = parser.parse_args(argv)
        if not getattr(args, "_run", None):
            parser.print_help()
            return USAGE_EXIT
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001  (a user's mistake becomes one line; anything else re-raises)
        line = user_error_line(exc)
        if line is None:
            raise
        print(f"{prog}: {line}", file=sys.stderr)
        return USAGE_EXIT


if __name__ == "__main__":
    sys.exit(main())
