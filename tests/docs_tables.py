"""Option tables in the docs, generated from the commands' own argparse parsers.

A block in a Markdown file

    <!-- options: serve -->
    ...
    <!-- /options -->

holds the table of ``contextdeque serve``'s options (name, default, help) as the parser
defines them. ``tests/test_docs_agree.py`` fails when a block differs from the parser;
``python tests/docs_tables.py`` rewrites every block in README.md and docs/*.md.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- options: ([\w-]+) -->\n)(.*?)(<!-- /options -->)", re.S)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def command_parser(command: str) -> argparse.ArgumentParser:
    """The parser of ``contextdeque COMMAND`` (built by the command's own ``add_arguments``)."""
    module = importlib.import_module(f"contextdeque.cli.{command.replace('-', '_')}")
    p = argparse.ArgumentParser(prog=f"contextdeque {command}")
    module.add_arguments(p)
    return p


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def options_table(command: str) -> str:
    """The Markdown table of ``command``'s options: flags, default, help."""
    rows = ["| option | default | |", "|---|---|---|"]
    for a in command_parser(command)._actions:
        if isinstance(a, argparse._HelpAction) or not a.option_strings:
            continue
        flags = ", ".join(f"`{o}`" for o in a.option_strings)
        if a.nargs == "?" and a.metavar:
            flags += f" [{a.metavar}]"
        elif a.nargs != 0 and not isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            flags += f" {a.metavar or a.dest.upper()}"
        if isinstance(a, argparse._StoreTrueAction):
            default = "off"
        elif a.default is None:
            default = "—"
        else:
            default = f"`{a.default}`"
        rows.append(f"| {flags} | {default} | {_cell(a.help or '')} |")
    return "\n".join(rows) + "\n"


def stale_blocks() -> list[tuple[Path, str, str, str]]:
    """(file, command, text in the file, text the parser gives) of every block that differs."""
    out = []
    for path in doc_files():
        for m in BLOCK.finditer(path.read_text()):
            want = options_table(m.group(2))
            if m.group(3) != want:
                out.append((path, m.group(2), m.group(3), want))
    return out


def rewrite() -> list[Path]:
    """Regenerate every block; the files changed."""
    changed = []
    for path in doc_files():
        text = path.read_text()
        new = BLOCK.sub(lambda m: m.group(1) + options_table(m.group(2)) + m.group(4), text)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


if __name__ == "__main__":
    for p in rewrite():
        print(f"rewrote {p.relative_to(ROOT)}", file=sys.stderr)
