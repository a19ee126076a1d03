"""``contextdeque`` command line. Each subcommand lives in its own module exposing
``add_arguments(parser)`` and ``run(args) -> int`` (exit code)."""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "verify-model": ("contextdeque.verify", "exactness gate: relocation vs transformers' own forward, layer by layer"),
    "fidelity": ("contextdeque.fidelity.cli", "every reuse arm vs a full re-prefill on the probe set"),
    "bench": ("contextdeque.bench", "apply (relocate+patch) vs re-prefill and vs its roofline floor"),
    "window-bench": ("contextdeque.window.bench", "slide and fork cost on a 4x512-token window"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="contextdeque", description="position-free KV-cache chunks for agent context windows")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # command not built yet
            raise
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
