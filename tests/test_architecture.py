"""Checks that keep the layout so: no import cycle among the project's modules, no long function, and
a complexity gate that really gates.

The import contracts themselves (demo > api > worker > trainer > (offload | store) > contract, the job
library without Celery, SQLAlchemy or Prometheus, the API never importing the engine) are `lint-imports`
in `make lint`, configured in pyproject.toml ([tool.importlinter]); types are `mypy` there too, and
the complexity gate (McCabe's C901, pylint's too-many-branches and too-many-statements) is `ruff check`,
configured in [tool.ruff.lint]. Here: the 80-line cap per function, which ruff does not measure, and
proof that the project's ruff configuration fails a complex function. Fast: no services, no torch.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import grimp
import networkx  # torch's own dependency
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("demo", "api", "worker", "serving", "trainer", "offload", "store", "contract")
MAX_FUNCTION_LINES = 80


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    """The import graph of the project's packages: every import statement, also inside functions.

    Imports under ``if TYPE_CHECKING:`` count: they do not run, but two modules that need each other's
    names to be typed are one module split in two (a circle in disguise). Only explicit imports are
    edges: grimp does not add the implicit one by which
    importing ``pkg.sub`` first runs ``pkg/__init__.py`` (with it, every ``__init__`` that re-exports
    a submodule would be a "cycle"), but an explicit ``from pkg import name`` in a module that
    ``pkg/__init__.py`` imports is a real cycle (a partly initialised package) and counts.
    """
    g = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False, cache_dir=None)
    for pkg in PACKAGES:  # the packages of this checkout, not some other copy on sys.path
        spec = importlib.util.find_spec(pkg)
        origin = Path(spec.origin if spec and spec.origin else "?").resolve()
        assert origin.parent == ROOT / pkg, f"{pkg} is found at {origin}, not in {ROOT}"
    return g


def strongly_connected_components(graph: grimp.ImportGraph) -> list[list[str]]:
    """Groups of modules that import each other (more than one module each), each sorted."""
    digraph = networkx.DiGraph(
        (importer, imported)
        for importer in graph.modules
        for imported in graph.find_modules_directly_imported_by(importer)
    )
    return sorted(sorted(c) for c in networkx.strongly_connected_components(digraph) if len(c) > 1)


def shortest_cycle(graph: grimp.ImportGraph, component: list[str]) -> list[str]:
    """The shortest import cycle through the component's first module: [m, ..., m]."""
    start = component[0]
    best: list[str] | None = None
    for succ in sorted(graph.find_modules_directly_imported_by(start)):
        if succ not in component:
            continue
        chain = graph.find_shortest_chain(importer=succ, imported=start)
        if chain is not None and (best is None or len(chain) + 1 < len(best)):
            best = [start, *chain]
    assert best is not None
    return best


def describe_cycle(graph: grimp.ImportGraph, cycle: list[str]) -> str:
    lines = [" -> ".join(cycle)]
    for importer, imported in pairwise(cycle):
        details = graph.get_import_details(importer=importer, imported=imported)
        where = ", ".join(f"l.{d['line_number']}: {d['line_contents'].strip()}" for d in details)
        lines.append(f"      {importer} -> {imported} ({where})")
    return "\n".join(lines)


def test_no_import_cycle(graph: grimp.ImportGraph) -> None:
    components = strongly_connected_components(graph)
    report = []
    for component in components:
        members = set(component)
        edges = [
            f"      {importer} -> {imported}"
            for importer in component
            for imported in sorted(graph.find_modules_directly_imported_by(importer) & members)
        ]
        report.append(
            f"  cycle among {len(component)} modules: {', '.join(component)}\n"
            f"    shortest: {describe_cycle(graph, shortest_cycle(graph, component))}\n"
            f"    all {len(edges)} imports inside it:\n" + "\n".join(edges)
        )
    assert not components, (
        f"import cycles among the project's modules ({len(components)}); break each one (move the shared "
        "code down a layer, or pass a callable in):\n" + "\n".join(report)
    )


def test_no_function_over_80_lines() -> None:
    lengths: dict[str, int] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if "__pycache__" in path.parts:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    assert node.end_lineno is not None
                    lengths[f"{rel}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    assert lengths, f"no functions found under {ROOT}"
    over = sorted(((n, where) for where, n in lengths.items() if n > MAX_FUNCTION_LINES), reverse=True)
    assert not over, (
        f"functions over {MAX_FUNCTION_LINES} lines under {', '.join(p + '/' for p in PACKAGES)} (split each "
        "into named steps, each with one job):\n" + "\n".join(f"  {where}: {n} lines" for n, where in over)
    )


GATE_CODES = ("C901", "PLR0912", "PLR0915")


def ruff_gate(path: Path) -> subprocess.CompletedProcess[str]:
    """The project's ruff configuration run on one file, only the complexity gate's rules."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--no-cache",
            "--config",
            str(ROOT / "pyproject.toml"),
            "--select",
            ",".join(GATE_CODES),
            "--output-format",
            "concise",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_complexity_gate_fails_a_complex_function(tmp_path: Path) -> None:
    # 11 decisions: McCabe complexity 12 (> 10) and 12 branches (at pylint's 12, not over it)
    branches = "\n".join(f"    if x == {i}:\n        return {i}" for i in range(11))
    path = tmp_path / "branchy.py"
    path.write_text(f"def branchy(x: int) -> int:\n{branches}\n    return -1\n", encoding="utf-8")
    result = ruff_gate(path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "C901" in result.stdout and "`branchy` is too complex (12 > 10)" in result.stdout, result.stdout


def test_complexity_gate_fails_too_many_statements(tmp_path: Path) -> None:
    body = "\n".join(f"    x += {i}" for i in range(51))
    path = tmp_path / "long.py"
    path.write_text(f"def long(x: int) -> int:\n{body}\n    return x\n", encoding="utf-8")
    result = ruff_gate(path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "PLR0915" in result.stdout, result.stdout


def test_complexity_gate_passes_a_simple_function(tmp_path: Path) -> None:
    path = tmp_path / "simple.py"
    path.write_text(
        "def simple(x: int) -> int:\n    if x > 0:\n        return x\n    return -x\n", encoding="utf-8"
    )
    result = ruff_gate(path)
    assert result.returncode == 0, result.stdout + result.stderr
