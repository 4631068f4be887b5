"""No module of src/ or bench/ imports another in a cycle, counting every import statement.

The graph is built from the source with ``ast``, so imports inside functions, methods,
``if TYPE_CHECKING:`` blocks and ``try:`` blocks all count: a cycle hidden in a function-level
import still couples the two modules both ways. An edge goes from the importing module to the
most specific module the statement names (``from a.b import c`` reaches ``a.b.c`` when that is a
module, else ``a.b``), never to the parent packages Python also initialises on the way, since
those are loaded before any of their submodules run.

Names are resolved the way each tree is run:

* ``src/``: packages on ``sys.path`` (``portattn.*``, ``kubematrix.*``); relative imports
  against the importing module's package.
* ``bench/``: scripts run as ``python bench/x.py`` (their folder is ``sys.path[0]``) or imported
  as ``bench.x``; a bare ``import y`` from a file in ``bench/`` (or a folder under it) is that
  folder's ``y.py`` when one exists, else ``bench/y.py``.

Imports of anything outside these trees (torch, triton, the standard library) are not edges.
``importlib.import_module("literal")`` calls are edges too: they are imports by another name.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: (tree, the folder its module names are relative to).
TREES = (("src", ROOT / "src"), ("bench", ROOT))


@dataclass(frozen=True)
class Edge:
    """One import statement: ``source`` imports ``target`` at ``path:line``."""

    source: str
    target: str
    path: str
    line: int


def _module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def collect_modules() -> dict[str, Path]:
    """Every module of src/ and bench/, by dotted name."""
    modules: dict[str, Path] = {}
    for tree, base in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            if "__pycache__" in path.parts or ".egg-info" in str(path):
                continue
            modules[_module_name(path, base)] = path
    return modules


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _resolve(name: str, importer: str, importer_path: Path, modules: dict[str, Path]) -> str | None:
    """The module of src/ or bench/ an absolute import of ``name`` loads, or None."""
    # (candidate, how many leading parts are only where it was looked for)
    candidates = [(name, 0)]
    if importer.split(".")[0] == "bench":
        folder = _package_of(importer, importer_path) or "bench"
        candidates += [(f"{folder}.{name}", folder.count(".") + 1), (f"bench.{name}", 1)]
    for candidate, fixed in candidates:
        # The longest prefix that is a module of ours: ``a.b.func`` imports ``a.b``.
        parts = candidate.split(".")
        for end in range(len(parts), fixed, -1):
            prefix = ".".join(parts[:end])
            if prefix in modules:
                return prefix
    return None


def _import_edges(name: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = str(path.relative_to(ROOT))
    package = _package_of(name, path)
    edges: list[Edge] = []

    def add(target_name: str, line: int) -> None:
        target = _resolve(target_name, name, path, modules)
        if target is not None and target != name:
            edges.append(Edge(name, target, rel, line))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(p for p in [*base_parts, node.module or ""] if p)
            else:
                base = node.module or ""
            for alias in node.names:
                # ``from a import b`` loads the module a.b when there is one, else a.
                add(f"{base}.{alias.name}" if alias.name != "*" else base, node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            add(node.args[0].value, node.lineno)
    return edges


def build_graph() -> dict[str, list[Edge]]:
    """Module -> its import edges to other modules of src/ and bench/."""
    modules = collect_modules()
    return {name: _import_edges(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, list[Edge]]) -> list[list[Edge]]:
    """One cycle through each strongly connected group of modules (Tarjan), as its edges."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(start: str) -> None:
        # Iterative Tarjan: (node, position in its edge list).
        work = [(start, 0)]
        while work:
            node, pos = work.pop()
            if pos == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            edges = graph.get(node, [])
            if pos < len(edges):
                work.append((node, pos + 1))
                nxt = edges[pos].target
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])

    for node in sorted(graph):
        if node not in index:
            visit(node)

    cycles = []
    for group in groups:
        start = min(group)
        # Shortest path from start back to itself inside the group (breadth first).
        came: dict[str, Edge] = {}
        frontier = [start]
        found: Edge | None = None
        while frontier and found is None:
            nxt_frontier = []
            for node in frontier:
                for edge in graph[node]:
                    if edge.target not in group:
                        continue
                    if edge.target == start:
                        found = edge
                        break
                    if edge.target not in came:
                        came[edge.target] = edge
                        nxt_frontier.append(edge.target)
                if found is not None:
                    break
            frontier = nxt_frontier
        assert found is not None
        path = [found]
        while path[0].source != start:
            path.insert(0, came[path[0].source])
        cycles.append(path)
    return sorted(cycles, key=lambda c: c[0].source)


def describe(cycle: list[Edge]) -> str:
    names = " -> ".join([cycle[0].source, *(e.target for e in cycle)])
    where = "; ".join(f"{e.source} imports {e.target} at {e.path}:{e.line}" for e in cycle)
    return f"{names}\n    ({where})"


def test_no_module_of_src_or_bench_imports_itself_through_others():
    cycles = find_cycles(build_graph())
    assert not cycles, "import cycles (function-level imports count):\n  " + "\n  ".join(
        describe(c) for c in cycles
    )


def test_the_graph_sees_function_level_and_importlib_imports():
    modules = collect_modules()
    assert {"kubematrix.launcher", "portattn.kernels.paged_attention"} <= modules.keys()
    graph = build_graph()
    targets = {e.target for edges in graph.values() for e in edges}
    assert "kubematrix.render" in targets  # a module-level import in src/
    # A function-level import counts: __main__ loads the local runner inside a function.
    assert any(e.target == "kubematrix.local" for e in graph["kubematrix.__main__"])


def test_bench_scripts_bare_imports_resolve_to_their_folder_then_bench():
    fake = Path("/x")
    modules = {
        "bench._common": fake,
        "bench.diag._shared": fake,
        "bench.diag.tma": fake,
        "bench.run": fake,
        "portattn.layout": fake,
    }
    diag = Path("/x/bench/diag/tma.py")
    assert _resolve("_shared", "bench.diag.tma", diag, modules) == "bench.diag._shared"
    assert _resolve("_common", "bench.diag.tma", diag, modules) == "bench._common"
    assert _resolve("portattn.layout.X", "bench.run", Path("/x/bench/run.py"), modules) == (
        "portattn.layout"
    )
    assert _resolve("torch", "bench.run", Path("/x/bench/run.py"), modules) is None
    # Outside bench/, a bare name is not looked up in bench/.
    assert _resolve("_common", "portattn.layout", Path("/x/layout.py"), modules) is None


def test_a_cycle_through_a_function_level_import_is_found_and_named():
    edge = Edge
    graph = {
        "a": [edge("a", "b", "a.py", 1)],
        "b": [edge("b", "c", "b.py", 3)],
        "c": [edge("c", "a", "c.py", 40)],  # e.g. inside a function
        "d": [edge("d", "a", "d.py", 2)],
    }
    cycles = find_cycles(graph)
    assert len(cycles) == 1
    text = describe(cycles[0])
    assert text.startswith("a -> b -> c -> a")
    assert "c imports a at c.py:40" in text


def test_a_graph_without_cycles_passes():
    edge = Edge
    graph = {"a": [edge("a", "b", "a.py", 1)], "b": [edge("b", "c", "b.py", 1)], "c": []}
    assert find_cycles(graph) == []
