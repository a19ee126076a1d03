"""Packaging and layering rules: kernels/agents live only in the contextdeque namespace, and no
layer imports a layer above it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package-relative module prefix -> layers it must not import
FORBIDDEN = {
    "kernels": ["contextdeque.layout", "contextdeque.operator", "contextdeque.patch", "contextdeque.backends",
                "contextdeque.stores", "contextdeque.window", "contextdeque.fidelity", "contextdeque.arms"],
    "contextdeque/operator.py": ["contextdeque.backends", "contextdeque.stores", "contextdeque.window", "contextdeque.fidelity"],
    "contextdeque/layout.py": ["contextdeque.backends", "contextdeque.stores", "contextdeque.window", "contextdeque.patch"],
    "contextdeque/patch": ["contextdeque.stores", "contextdeque.window", "contextdeque.fidelity", "contextdeque.arms"],
    "contextdeque/stores": ["contextdeque.backends", "contextdeque.window", "contextdeque.fidelity", "contextdeque.patch",
                            "contextdeque.operator"],
    "contextdeque/backends": ["contextdeque.window", "contextdeque.fidelity", "contextdeque.arms"],
    "contextdeque/window": ["contextdeque.fidelity", "contextdeque.arms", "contextdeque.agents"],
}


def _imports(path: Path) -> set[str]:
    pkg_parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if pkg_parts[0] in ("kernels", "agents"):
        pkg_parts = ["contextdeque", *pkg_parts]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - node.level]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("where", sorted(FORBIDDEN))
def test_layers_never_import_upward(where):
    target = ROOT / where
    files = [target] if target.is_file() else sorted(target.rglob("*.py"))
    assert files
    for f in files:
        for mod in _imports(f):
            for bad in FORBIDDEN[where]:
                assert not (mod == bad or mod.startswith(bad + ".")), f"{f.relative_to(ROOT)} imports {mod}"


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

    assert contextdeque.kernels.fused_apply is not None
    assert Path(contextdeque.kernels.__file__).parent.name == "kernels"
    assert contextdeque.agents.__name__ == "contextdeque.agents"
