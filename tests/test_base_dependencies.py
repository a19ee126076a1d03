"""The README installs contextdeque without extras and says `contextdeque demo --agent
web|video|doc` runs every agent: what those runs import must come with the base dependencies.

Two checks: every third-party module that ``agents/`` imports (at module level or inside a
function) is a *declared* base dependency, not one that happens to arrive through another; and a
real ``contextdeque demo --agent video`` run (its default path: the clip built from real photographs,
the image-span emulation) imports only distributions reachable from the base requirements."""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIST = "contextdeque"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: str, extras: frozenset[str] = frozenset()) -> set[str]:
    """Normalized names ``dist`` requires, without those behind an extra not in ``extras``."""
    out = set()
    for req in md.requires(dist) or ():
        name, _, marker = req.partition(";")
        extra = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", marker)
        if extra and extra.group(1) not in extras:
            continue
        out.add(_norm(re.match(r"\s*[A-Za-z0-9][A-Za-z0-9._-]*", name).group(0).strip()))
    return out


def base_requirements() -> set[str]:
    return _requirements(DIST)


def base_closure() -> set[str]:
    """Every distribution a plain ``pip install contextdeque`` brings: the base requirements and
    theirs, transitively (the installed ones; a missing one would fail the import check anyway)."""
    seen: set[str] = set()
    todo = list(base_requirements())
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo.extend(_requirements(name))
        except md.PackageNotFoundError:
            continue
    return seen


def module_distributions() -> dict[str, set[str]]:
    """Top-level import name -> normalized distribution names providing it."""
    return {mod: {_norm(d) for d in dists} for mod, dists in md.packages_distributions().items()}


def third_party_imports(path: Path) -> set[str]:
    """Top-level names of the absolute, non-stdlib, non-contextdeque imports anywhere in ``path``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("__future__", DIST)}


def test_the_video_agents_libraries_are_base_dependencies():
    base = base_requirements()
    for name in ("av", "scikit-image", "pillow"):
        assert name in base, f"{name} must be a base dependency: `contextdeque demo --agent video` needs it"


def test_every_library_the_agents_import_is_a_declared_base_dependency():
    base, dists = base_requirements(), module_distributions()
    missing = {}
    for path in sorted((ROOT / "agents").glob("*.py")) + [ROOT / "contextdeque" / "cli" / "demo.py"]:
        for mod in third_party_imports(path):
            provided_by = dists.get(mod)
            assert provided_by, f"{path.name} imports {mod!r}, which no installed distribution provides"
            if not provided_by & base:
                missing.setdefault(path.name, set()).add(mod)
    assert not missing, f"imported but not declared in [project] dependencies: {missing}"


def test_the_import_check_sees_an_undeclared_import(tmp_path):
    """The static check can fail: an import of a library that is only a test extra is caught."""
    src = tmp_path / "agent.py"
    src.write_text("def f():\n    import hypothesis\n")
    dists = module_distributions()
    assert third_party_imports(src) == {"hypothesis"}
    assert not dists["hypothesis"] & base_requirements()
    assert "hypothesis" in _requirements(DIST, frozenset({"test"}))


_RUN_VIDEO_DEMO = """
import json, site, sys

site.addsitedir(sys.argv[2])  # the base install's site-packages (its .pth files map agents/)
from contextdeque.cli import main

assert main(["demo", "--agent", "video", "--model", "tiny", "--json", "--max-new-tokens", "1",
             "--segments", "2", "--no-measure", "--threads", "1", "--trace", sys.argv[1]]) == 0
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def base_site_packages(dest: Path) -> Path:
    """A site-packages directory holding (as symlinks) only what ``pip install contextdeque``
    brings: each distribution of the base closure, its files and its metadata, and contextdeque's
    own installation (editable or not)."""
    dest.mkdir()
    for name in base_closure() | {DIST}:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        site_dir = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or ()} - {".."}
        if name == DIST:  # its metadata may sit in the checkout (egg-info); take the installed one's
            tops = {p.name for p in site_dir.glob("*contextdeque*")} - {"contextdeque.egg-info"}
        for top in tops:
            if (site_dir / top).exists() and not (dest / top).exists():
                (dest / top).symlink_to(site_dir / top)
    return dest


def test_the_video_demo_runs_with_only_the_base_install(tmp_path):
    """A real `contextdeque demo --agent video` (its default clip built from scikit-image's
    photographs, encoded and decoded with PyAV, through the image-span emulation) in a fresh
    interpreter that sees only the base install (``-S``: no site-packages but a copy of the base
    closure's): it runs to completion. Remove av, scikit-image or pillow from the base
    dependencies and it fails."""
    site_dir = base_site_packages(tmp_path / "site")
    assert not (site_dir / "hypothesis").exists()  # a test-only extra really is absent
    proc = subprocess.run([sys.executable, "-S", "-c", _RUN_VIDEO_DEMO, str(tmp_path / "t.jsonl"), str(site_dir)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    summary, imported = json.loads(lines[-2]), set(json.loads(lines[-1]))
    assert summary["agent"] == "video" and summary["frames"] > 0
    assert {"av", "skimage", "PIL"} <= imported  # the clip really was built and decoded
