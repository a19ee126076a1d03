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
    ("contextdeque.session",),
    ("contextdeque.agents",),
    ("contextdeque.serve", "contextdeque.integrations"),
    ("contextdeque.cli",),
]
RANK = {prefix: rank for rank, group in enumerate(LAYERS) for prefix in group}
# Narrower rules on top of the ranks: traces are plain data that a scheduler or replay reads, so
# they stay independent of the window and of their siblings; the scheduler decides from costs
# alone, independent of the evaluation arms and of the trace format. Measurement (eval) is for
# the CLI, benches and tests: what runs in a server or an agent (serve, agents, the session layer)
# never imports it. The stores hold bytes: they stand on core alone (kernels and errors below it),
# never on a model or a patch.
ALSO_FORBIDDEN = {
    "contextdeque.traces": ("contextdeque.window", "contextdeque.eval", "contextdeque.scheduler"),
    "contextdeque.scheduler": ("contextdeque.eval", "contextdeque.traces"),
    "contextdeque.session": ("contextdeque.eval", "contextdeque.replay"),
    "contextdeque.agents": ("contextdeque.eval",),
    "contextdeque.serve": ("contextdeque.eval",),
    "contextdeque.stores": ("contextdeque.model", "contextdeque.patch"),
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


@pytest.mark.parametrize("module, source, found", [
    ("contextdeque.serve.engine", "from ..eval.arms import ReprefillArm\n", ["contextdeque.eval.arms", "contextdeque.eval.arms.ReprefillArm"]),
    ("contextdeque.agents.base", "def f():\n    from contextdeque.eval.fidelity.probes import tokenize\n",
     ["contextdeque.eval.fidelity.probes", "contextdeque.eval.fidelity.probes.tokenize"]),
    ("contextdeque.session.measure", "from contextdeque.eval import harness\n", ["contextdeque.eval", "contextdeque.eval.harness"]),
    ("contextdeque.stores.capsule", "from ..model.hf import HFBackend\n", ["contextdeque.model.hf", "contextdeque.model.hf.HFBackend"]),
    ("contextdeque.stores.base", "if TYPE_CHECKING:\n    from contextdeque.patch import Patch\n", ["contextdeque.patch", "contextdeque.patch.Patch"]),
])
def test_the_narrower_rules_catch_a_forbidden_import(module, source, found):
    """serve / agents / the session layer never import eval (not even inside a function), and the
    stores never import a model or a patch: each is caught although it goes downward by rank."""
    lines = upward_imports(source, module)
    assert [line.split(" imports ")[1].split(" (")[0] for line in lines] == found
    assert all("forbidden to" in line for line in lines)


def package_of(module: str) -> str | None:
    """The package a module belongs to for the cycle rule: the longest prefix in LAYERS
    (``contextdeque.core.errors`` is its own, below the kernels; None: not one of ours)."""
    best = None
    for prefix in RANK:
        if _within(module, prefix) and (best is None or len(prefix) > len(best)):
            best = prefix
    return best


def package_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages it imports, from module -> imported names."""
    graph: dict[str, set[str]] = {}
    for module, names in modules.items():
        mine = package_of(module)
        if mine is None:
            continue
        edges = graph.setdefault(mine, set())
        for name in names:
            theirs = package_of(name)
            if theirs is not None and theirs != mine:
                edges.add(theirs)
    return graph


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle between packages, each once, as the packages around it (first = smallest name)."""
    cycles: set[tuple[str, ...]] = set()

    def walk(path: list[str]) -> None:
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == path[0]:
                i = path.index(min(path))
                cycles.add(tuple(path[i:] + path[:i]))
            elif nxt not in path and nxt > path[0]:
                walk(path + [nxt])

    for start in sorted(graph):
        walk([start])
    return [list(c) for c in sorted(cycles)]


def _source_imports() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p.read_text(), _module_name(p), p.name == "__init__.py") for p in _sources()}


def test_no_cycles_between_packages():
    """The packages form a DAG: no package imports, directly or around a loop, one that imports it
    (the ranks forbid climbing; this also rules out two packages of one rank leaning on each other)."""
    graph = package_graph(_source_imports())
    assert len(graph) > 8
    assert package_cycles(graph) == []


def test_the_cycle_check_catches_a_cycle():
    """The check can fail: a loop through two or three packages is reported, once."""
    modules = {
        "contextdeque.eval.bench": {"contextdeque.traces.io"},
        "contextdeque.traces.io": {"contextdeque.scheduler.cost", "contextdeque.core.kv"},
        "contextdeque.scheduler.cost": {"contextdeque.eval.arms"},
        "contextdeque.core.kv": set(),
        "contextdeque.window.slot": {"contextdeque.core.kv"},
    }
    assert package_cycles(package_graph(modules)) == [["contextdeque.eval", "contextdeque.traces", "contextdeque.scheduler"]]
    modules["contextdeque.core.kv"] = {"contextdeque.window.slot"}
    assert ["contextdeque.core", "contextdeque.window"] in package_cycles(package_graph(modules))


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


# What a server or an agent loads at run time: none of it may pull in the evaluation package.
RUN_TIME_MODULES = (
    "contextdeque.serve", "contextdeque.serve.engine", "contextdeque.serve.app", "contextdeque.serve.conversation",
    "contextdeque.serve.metrics", "contextdeque.serve.store_bench", "contextdeque.session",
    "contextdeque.agents", "contextdeque.agents.base", "contextdeque.agents.doc", "contextdeque.agents.web",
    "contextdeque.agents.video", "contextdeque.agents.media", "contextdeque.agents.scenarios",
    "contextdeque.agents.messages", "contextdeque.agents.measure",
)


def _loads_eval(modules: tuple[str, ...]) -> list[str]:
    """The ``contextdeque.eval`` modules a fresh interpreter holds after importing ``modules``."""
    code = (
        "import importlib, sys\n"
        f"for m in {list(modules)!r}: importlib.import_module(m)\n"
        "print(' '.join(sorted(m for m in sys.modules if m == 'contextdeque.eval' or m.startswith('contextdeque.eval.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_serve_and_agents_do_not_load_eval():
    """``import contextdeque.serve`` and the agents' run-time modules leave ``contextdeque.eval``
    out of ``sys.modules`` (checked in a fresh interpreter: imports inside functions count only
    when they run, which the layering rules above forbid anyway)."""
    assert _loads_eval(RUN_TIME_MODULES) == []


def test_the_sys_modules_check_sees_eval():
    """The check can fail: a module that does load eval is seen."""
    assert "contextdeque.eval.bench" in _loads_eval(("contextdeque.eval.bench",))
