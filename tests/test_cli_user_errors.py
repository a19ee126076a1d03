"""A user's first hour with the CLI, from the README's plain install (no extras): every command's
``--help`` works, and a typical mistake with each ends in one line on stderr and its exit status
(2, or the status the command documents), never a traceback; ``serve`` names the extra it needs;
``contextdeque --help`` and ``import contextdeque`` load neither transformers nor a command.

The interpreter sees only the base install (``test_base_dependencies.base_site_packages``: the
base requirements' closure and contextdeque, without fastapi, uvicorn, valkey, prometheus_client,
openai, triton or matplotlib)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_base_dependencies import base_site_packages

from contextdeque.cli import COMMANDS, USAGE_EXIT, main, user_error_line

EXTRA_MODULES = ("fastapi", "uvicorn", "valkey", "prometheus_client", "openai", "triton", "matplotlib")
NO_MODEL = "/nonexistent/contextdeque-model"

# command -> (a typical mistake's arguments, its exit status, a word its one line must hold)
MISTAKES: dict[str, tuple[list[str], int, str]] = {
    "demo": (["--model", NO_MODEL, "--no-measure"], USAGE_EXIT, "ModelLoadError"),
    "verify-model": ([NO_MODEL], USAGE_EXIT, "ModelLoadError"),  # (a model it refuses is its verdict, exit 1)
    "zoo": (["--threads", "many"], USAGE_EXIT, "--threads"),
    "fidelity": (["--model", NO_MODEL, "--items", "1"], USAGE_EXIT, "ModelLoadError"),
    "bench": (["--model", NO_MODEL], USAGE_EXIT, "ModelLoadError"),
    "window-bench": (["--model", NO_MODEL], USAGE_EXIT, "ModelLoadError"),
    "serve": ([], USAGE_EXIT, "pip install 'contextdeque[serve]'"),
    "loadtest": (["--url", "http://127.0.0.1:9"], USAGE_EXIT, "FetchError"),
    "load-bench": (["--model", NO_MODEL], USAGE_EXIT, "ModelLoadError"),
    "store-bench": ([], USAGE_EXIT, "pip install 'contextdeque[serve]'"),
    "bench-vllm": ([], USAGE_EXIT, "pip install 'contextdeque[vllm]'"),
    "traces": (["validate", "/nonexistent/trace.jsonl"], 1, "trace.jsonl"),  # documented: traces/replay exit 1
    "replay": (["/nonexistent/trace.jsonl"], 1, "trace.jsonl"),
    "replay-bench": (["--seeds", "four"], USAGE_EXIT, "--seeds"),
    "soak": (["--model", NO_MODEL, "--ops", "1"], USAGE_EXIT, "ModelLoadError"),
    "calibrate": (["--model", NO_MODEL], USAGE_EXIT, "ModelLoadError"),
}

_DRIVER = """
import contextlib, io, json, site, sys, traceback
site.addsitedir(sys.argv[1])
from contextdeque.cli import main
out = []
for argv in json.loads(sys.argv[2]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            code = "raised"
            traceback.print_exc()
    out.append({"argv": argv, "code": code, "stderr": err.getvalue()})
print(json.dumps(out))
"""


def _base_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": "", "COLUMNS": "80"}


@pytest.fixture(scope="module")
def base_site(tmp_path_factory) -> Path:
    site_dir = base_site_packages(tmp_path_factory.mktemp("base") / "site")
    for mod in EXTRA_MODULES:
        assert not (site_dir / mod).exists(), f"{mod} must not be in the base install"
    return site_dir


def _drive(site_dir: Path, argvs: list[list[str]], cwd: Path) -> list[dict]:
    proc = subprocess.run([sys.executable, "-S", "-c", _DRIVER, str(site_dir), json.dumps(argvs)],
                          capture_output=True, text=True, cwd=cwd, timeout=1200, env=_base_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_command_is_covered():
    assert set(MISTAKES) == set(COMMANDS)


@pytest.mark.slow
def test_help_and_a_mistake_per_command_from_the_base_install(base_site, tmp_path):
    cases: list[tuple[list[str], tuple[int, str] | None]] = [([name, "--help"], None) for name in COMMANDS]
    cases += [([name, *args], (code, word)) for name, (args, code, word) in MISTAKES.items()]
    cases += [(["no-such-command"], (USAGE_EXIT, "invalid choice")), (["bench", "--threads", "-1"], (USAGE_EXIT, "--threads"))]
    # a --plot from the base install names the plot extra before any work
    cases += [([name, *args, "--plot", str(tmp_path / "p.png")], (USAGE_EXIT, "pip install 'contextdeque[plot]'"))
              for name, args in (("fidelity", ["--model", "tiny"]), ("loadtest", ["--url", "http://127.0.0.1:9"]),
                                 ("replay", ["/nonexistent/trace.jsonl"]))]
    results = _drive(base_site, [argv for argv, _ in cases], tmp_path)
    for (argv, expect), r in zip(cases, results):
        code, stderr = r["code"], r["stderr"]
        assert "Traceback" not in stderr, f"{argv}: {stderr}"
        if expect is None:  # --help
            assert code == 0, f"{argv}: {stderr}"
            continue
        lines = stderr.strip().splitlines()
        assert code == expect[0], f"{argv}: exit {code}, stderr {stderr!r}"
        assert len(lines) == 1, f"{argv}: not one line: {stderr!r}"
        assert expect[1] in lines[0], f"{argv}: {lines[0]!r} does not say {expect[1]!r}"


@pytest.mark.slow
def test_serve_from_the_base_install_names_its_extra_in_a_real_process(base_site, tmp_path):
    code = f"import site, sys; site.addsitedir({str(base_site)!r}); from contextdeque.cli import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-S", "-c", code, "serve", "--port", "0"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=600, env=_base_env())
    assert proc.returncode == USAGE_EXIT
    assert proc.stderr.strip() == ("contextdeque serve: this needs the optional 'serve' extra (missing module "
                                   "uvicorn): pip install 'contextdeque[serve]'")


def test_help_and_import_load_no_command_and_no_transformers():
    code = ("import sys, contextlib, io\n"
            "import contextdeque\n"
            "assert 'transformers' not in sys.modules and 'torch' not in sys.modules, 'import contextdeque'\n"
            "from contextdeque.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try:\n        main(['--help'])\n"
            "    except SystemExit as e:\n        assert e.code == 0\n"
            "assert all(n in out.getvalue() for n in " + repr(list(COMMANDS)) + ")\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') or "
            "m.startswith('contextdeque.') and m not in ('contextdeque.cli', 'contextdeque.core', 'contextdeque.core.errors'))\n"
            "assert not loaded, loaded\n"
            # a public name loads its module on first use (the window's, not the layers above it);
            # looking up the scheduler's placement by name imports its home (PLACEMENT_POLICIES.homes)
            "contextdeque.ContextWindow\n"
            "assert 'contextdeque.scheduler' not in sys.modules\n"
            "from contextdeque.window.placement import PLACEMENT_POLICIES\n"
            "assert 'scheduler' in PLACEMENT_POLICIES and 'contextdeque.scheduler' in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_base_env())
    assert proc.returncode == 0, proc.stderr
    # the agents (the demo's --placement scheduler) find the scheduler's placement by name
    code = ("from contextdeque.agents.base import AgentConfig\n"
            "from contextdeque.window.placement import PLACEMENT_POLICIES\n"
            "assert 'scheduler' in PLACEMENT_POLICIES\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_base_env())
    assert proc.returncode == 0, proc.stderr


def test_public_names_load_on_first_use():
    import contextdeque as cd

    from contextdeque.core.operator import relocate
    from contextdeque.window import ContextWindow

    assert cd.ContextWindow is ContextWindow and cd.relocate is relocate
    with pytest.raises(AttributeError):
        cd.no_such_name  # noqa: B018
    assert set(cd.__all__) <= set(dir(cd))


def test_a_user_error_is_one_line_and_a_bug_keeps_its_traceback(capsys):
    from contextdeque.core.errors import WindowError

    assert user_error_line(WindowError("budget_tokens must be > 0\n  got -1")) == "WindowError: budget_tokens must be > 0 got -1"
    assert "contextdeque[plot]" in user_error_line(ModuleNotFoundError("x", name="matplotlib.pyplot"))
    assert user_error_line(ModuleNotFoundError("x", name="not_an_extra")) is None
    assert user_error_line(FileNotFoundError(2, "No such file or directory", "/x.jsonl")).endswith("/x.jsonl")
    assert user_error_line(RuntimeError("a bug")) is None
    with pytest.raises(SystemExit) as e:  # argparse: one line, exit 2
        main(["window-bench", "--runs", "x"])
    assert e.value.code == USAGE_EXIT
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
