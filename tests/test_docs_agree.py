"""The docs' claims against the code: generated option tables match the parsers, every place that
names a default patch policy names the one the code uses, and what ``store=None`` gives is what
the docs say it gives."""

from __future__ import annotations

import re

import pytest

from docs_tables import BLOCK, ROOT, command_parser, doc_files, options_table, stale_blocks

DOCS = {p.relative_to(ROOT).as_posix(): p.read_text() for p in doc_files()}


def test_option_tables_match_the_parsers() -> None:
    blocks = [(name, m.group(2)) for name, text in DOCS.items() for m in BLOCK.finditer(text)]
    assert ("docs/serve.md", "serve") in blocks
    stale = [f"{p.relative_to(ROOT)} ({cmd})" for p, cmd, _, _ in stale_blocks()]
    assert not stale, f"option tables out of date in {stale}: run `python tests/docs_tables.py`"


def test_a_changed_option_makes_its_table_stale(monkeypatch) -> None:
    """The check can fail: a default that changes in the parser no longer matches the doc."""
    import contextdeque.cli.serve as serve_cli

    before = options_table("serve")
    real = serve_cli.add_arguments

    def changed(p) -> None:
        real(p)
        p.set_defaults(max_tokens=9999)

    monkeypatch.setattr(serve_cli, "add_arguments", changed)
    assert options_table("serve") != before and "`9999`" in options_table("serve")


# every phrasing the docs use to name the server's default patch policy
SERVER_DEFAULT = [
    r"default patch policy \(`([\w:-]+)`",
    r"latency-first by default \(`([\w:-]+)`",
    r"`patch_policy=\"([\w:-]+)\"` \(the server's default\)",
]


def test_every_doc_names_the_servers_default_policy_the_code_uses() -> None:
    from contextdeque.serve.engine import SERVE_POLICY

    found = [(name, m.group(1)) for name, text in DOCS.items() for pat in SERVER_DEFAULT for m in re.finditer(pat, text)]
    assert {n for n, _ in found} >= {"README.md", "docs/serve.md", "docs/window.md"}, found
    assert all(policy == SERVE_POLICY for _, policy in found), found
    help_text = next(a.help for a in command_parser("serve")._actions if a.dest == "patch_policy")
    assert f"{SERVE_POLICY} (the default" in help_text


def test_the_windows_default_policy_is_the_one_the_docs_name() -> None:
    from contextdeque.window.policy import make_policy

    text = DOCS["docs/window.md"]
    named = re.findall(r"`([\w:-]+)` is the default", text) + re.findall(r"`([\w:-]+)` \([^)]*what `default` means\)", text)
    assert len(named) == 2 and set(named) == {make_policy("default").name}, named


def test_store_none_is_what_the_docs_say(tmp_path, monkeypatch) -> None:
    from contextdeque.window.store import WindowStore

    monkeypatch.setenv("CONTEXTDEQUE_STORE_DIR", str(tmp_path))
    store = WindowStore.wrap(None).store
    names = [t.name for t in store.tiers]
    assert names == ["device", "host", "disk"] and all(t.budget_bytes is not None for t in store.tiers)
    claim = re.search(r"`store=None` builds (.*?)\n\n", DOCS["docs/window.md"], re.S)
    assert claim is not None
    text = claim.group(1)
    assert "unbounded" not in text and "bounded" in text and "default_store" in text
    assert all(f"`{n}`" in text for n in names)
    readme = re.search(r"\*\*Bounded memory by default\.\*\*(.*?)\n\n", DOCS["README.md"], re.S)
    assert readme is not None and all(f"`{n}`" in readme.group(1) for n in names)


@pytest.mark.parametrize("name", sorted(DOCS))
def test_no_doc_calls_store_none_unbounded(name: str) -> None:
    assert not re.search(r"store=None[^.\n]*unbounded", DOCS[name])
