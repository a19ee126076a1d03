"""Packaging and layering rules: kernels/agents live only in the contextdeque namespace, and no
layer imports a layer above it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The layers, lowest first: a module may import only from its own rank or below. Keys are module
# prefixes (the longest matching one decides); packages that do not exist yet are listed so they
# are checked the day they appear. core.errors is the one module below the kernels (they raise
# its typed errors); the rest of core sits on the kernels.
LAYERS: list[tuple[str, ...]] = [
    ("contextdeque.core.errors",),
    ("contextdeque.kernels",),
    ("contextdeque.core",),
    ("contextdeque.model",),
    ("contextdeque.patch",),
    ("contextdeque.stores",),
    ("contextdeque.window",),
    ("contextdeque.eval", "contextdeque.traces", "contextdeque.scheduler"),
    ("contextdeque.replay",),
    ("contextdeque.agents",),
    ("contextdeque.serve", "contextdeque.integrations"),
    ("contextdeque.cli",),
]
RANK = {prefix: rank for rank, group in enumerate(LAYERS) for prefix in group}
# Narrower rules on top of the ranks: traces are plain data that a scheduler or replay reads, so
# they stay independent of the window and of their siblings; the scheduler decides from costs
# alone, independent of the evaluation arms and of the trace format.
ALSO_FORBIDDEN = {
    "contextdeque.traces": ("contextdeque.window", "contextdeque.eval", "contextdeque.scheduler"),
    "contextdeque.scheduler": ("contextdeque.eval", "contextdeque.traces"),
}
PACKAGE_ROOT = "contextdeque"  # the package's own __init__ re-exports the public names: it sits on top


def rank_of(module: str) -> int | None:
    """The layer of ``module`` (None: not a contextdeque module, or the top-level package)."""
    best = None
    for prefix, rank in RANK.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, rank)
    if best is None and (module == PACKAGE_ROOT or module.startswith(PACKAGE_ROOT + ".")):
        return len(LAYERS) if module == PACKAGE_ROOT else None
    return None if best is None else best[1]


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in ("kernels", "agents"):
        parts = ["contextdeque", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> list[Path]:
    files = [p for d in ("contextdeque", "kernels", "agents") for p in sorted((ROOT / d).rglob("*.py"))]
    return [f for f in files if f.relative_to(ROOT).parts[-2:] != ("contextdeque", "__init__.py")]


def _imports(source: str, module: str, is_package: bool) -> set[str]:
    """Every module and ``module.name`` the source imports (relative imports resolved), type-only
    imports included: a layer must not even name a layer above it."""
    pkg_parts = module.split(".") if is_package else module.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def upward_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """``"module (layer) imports name (layer)"`` for every import in ``source`` that goes up."""
    mine = rank_of(module)
    assert mine is not None, f"{module} is in no layer: add its package to LAYERS"
    out = []
    for mod in sorted(_imports(source, module, is_package)):
        theirs = rank_of(mod)
        if theirs is not None and theirs > mine:
            out.append(f"{module} (layer {mine}) imports {mod} (layer {theirs})")
        for where, banned in ALSO_FORBIDDEN.items():
            if _within(module, where) and any(_within(mod, b) for b in banned):
                out.append(f"{module} imports {mod} (forbidden to {where})")
    return out


def test_every_layer_is_listed_and_known():
    """Every subpackage and top-level module of contextdeque belongs to a listed layer."""
    files = _sources()
    assert len(files) > 50
    for f in files:
        assert rank_of(_module_name(f)) is not None, f"{f.relative_to(ROOT)} is in no layer"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_layers_never_import_upward(path):
    assert upward_imports(path.read_text(), _module_name(path), path.name == "__init__.py") == []


@pytest.mark.parametrize("module, source, found", [
    ("contextdeque.window.slot", "from ..eval import arms\n", ["contextdeque.eval", "contextdeque.eval.arms"]),
    ("contextdeque.core.operator", "if TYPE_CHECKING:\n    from ..patch.base import Patch\n",
     ["contextdeque.patch.base", "contextdeque.patch.base.Patch"]),
    ("contextdeque.kernels.spec", "from ..core.chunk import Chunk\n", ["contextdeque.core.chunk", "contextdeque.core.chunk.Chunk"]),
    ("contextdeque.stores.base", "import contextdeque.window\n", ["contextdeque.window"]),
    ("contextdeque.eval.verify", "from contextdeque.cli import main\n", ["contextdeque.cli", "contextdeque.cli.main"]),
    ("contextdeque.traces.io", "from ..window import ContextWindow\n", ["contextdeque.window", "contextdeque.window.ContextWindow"]),
])
def test_the_layering_check_catches_an_upward_import(module, source, found):
    """The check can fail: an upward import (relative, absolute or type-only) is reported."""
    assert [line.split(" imports ")[1].split(" (")[0] for line in upward_imports(source, module)] == found


def test_imports_within_a_layer_and_downward_pass():
    assert upward_imports("from ..core.kv import concat_kv\nfrom .slot import Slot\n", "contextdeque.window.decode") == []
    assert upward_imports("from ..core.errors import PatchError\n", "contextdeque.kernels.spec") == []


def test_no_top_level_kernels_module_from_a_checkout():
    """Even with the checkout on sys.path (python -c from the repo root), transformers must not
    mistake our kernels/ folder for Hugging Face's `kernels` package."""
    code = "import transformers.utils.import_utils as iu; print(iu.is_kernels_available())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_installed_namespace():
    import contextdeque.agents
    import contextdeque.kernels

    from contextdeque.kernels import native

    assert Path(contextdeque.kernels.__file__).parent.name == "kernels"
    # the native kernel's C source is package data beside the module that builds it
    assert native.SOURCE_PATH.parent == Path(contextdeque.kernels.__file__).parent / "csrc"
    assert "cd_apply_many" in native.SOURCE_PATH.read_text()
    assert contextdeque.agents.__name__ == "contextdeque.agents"
