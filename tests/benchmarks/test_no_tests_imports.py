"""The benchmarks package works from an installed wheel, which ships `benchmarks` but not
`tests`: no module under benchmarks/ imports `tests`, and each imports with tests/ absent."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


def benchmark_modules() -> list[str]:
    """Dotted names of every module under benchmarks/."""
    return sorted(
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for p in BENCHMARKS.rglob("*.py")
    )


def imports_of_tests(path: Path) -> list[str]:
    """`line: module` for each import (top level or lazy) of `tests` or `tests.*` in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"{node.lineno}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    return found


def test_the_ast_check_sees_lazy_and_from_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import os\ndef f():\n    from tests.x import y\n    import tests\n")
    assert imports_of_tests(probe) == ["3: tests.x", "4: tests"]


def test_no_benchmark_module_imports_tests() -> None:
    offenders = {
        str(p.relative_to(REPO)): found
        for p in sorted(BENCHMARKS.rglob("*.py"))
        if (found := imports_of_tests(p))
    }
    assert not offenders, f"benchmarks import from tests/: {offenders}"


def test_every_benchmark_module_imports_without_tests(tmp_path: Path) -> None:
    """Import each module in a child whose path holds the repo's top-level entries but
    tests/ (symlinked), run from an empty directory."""
    site = tmp_path / "site"
    site.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in {"tests", ".git", ".venv"} and not entry.name.startswith("."):
            (site / entry.name).symlink_to(entry)
    modules = benchmark_modules()
    script = (
        "import importlib, importlib.util, sys\n"
        "assert importlib.util.find_spec('tests') is None, 'tests is importable'\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'tests' not in sys.modules, f'{name} imported tests'\n"
        f"print('imported', {len(modules)})\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert f"imported {len(modules)}" in run.stdout
