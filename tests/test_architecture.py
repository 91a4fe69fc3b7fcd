"""Checks that keep the layout so: no import cycle among the project's modules, no oversized module.

The import contracts themselves (api > worker > trainer > (offload | store), the job library without
Celery, SQLAlchemy or Prometheus, the API never importing the engine) are `lint-imports` in `make lint`,
configured in pyproject.toml ([tool.importlinter]); types are `mypy` there too. Fast: no services, no
torch.
"""

from __future__ import annotations

import importlib.util
from itertools import pairwise
from pathlib import Path

import grimp
import networkx  # torch's own dependency
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "worker", "trainer", "offload", "store")
MAX_LINES = 500


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


def test_no_module_over_500_lines() -> None:
    counts = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            counts[path.relative_to(ROOT).as_posix()] = len(path.read_text(encoding="utf-8").splitlines())
    assert counts, f"no modules found under {ROOT}"
    over = sorted(((n, p) for p, n in counts.items() if n > MAX_LINES), reverse=True)
    assert not over, (
        f"modules over {MAX_LINES} lines under {', '.join(p + '/' for p in PACKAGES)} (split each one "
        "along a job it does):\n" + "\n".join(f"  {p}: {n} lines" for n, p in over)
    )
