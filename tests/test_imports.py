"""The import graph: the launcher uses only dscale's public modules, and the benchmark has no cycle.

Read from the source (``ast``), function-level imports included, so a lazy import that closes a
circle is caught too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dscale.bench._scaling_models as scaling_models
import dscale.models
import launch.data
import launch.models

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (``from a import b``: a and a.b)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def test_the_launcher_imports_no_private_dscale_module() -> None:
    private = {
        f"{path.name}: {name}"
        for path in sorted((ROOT / "launch").glob("*.py"))
        for name in _imports(path)
        if name.split(".")[0] == "dscale" and any(p.startswith("_") for p in name.split(".")[1:])
    }
    assert not private, sorted(private)


def test_the_benchmark_modules_import_each_other_without_a_cycle() -> None:
    modules = {f"dscale.bench.{p.stem}": p for p in (ROOT / "dscale" / "bench").glob("*.py")}
    edges = {m: {n for n in _imports(p) if n in modules and n != m} for m, p in modules.items()}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        for nxt in sorted(edges[module]):
            if nxt in path:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif len(path) < len(modules):
                visit(nxt, [*path, nxt])

    for module in sorted(edges):
        visit(module, [module])
    assert not cycles, cycles[:3]


def test_the_launcher_and_the_scaling_benchmark_share_the_public_models() -> None:
    # One definition: the benchmark trains exactly what the launcher's demo job trains.
    assert launch.models.GPT is scaling_models.GPT is dscale.models.GPT
    assert launch.models.MLP is scaling_models.MLP is dscale.models.MLP
    assert scaling_models.batches is dscale.models.token_batches
    tokens = launch.data.synthetic_batches(3, 1, 8, 2, 0.1, 256)(5)
    assert (tokens == dscale.models.token_batches(3, 8, 2, 0.1, 256, rank=1)(5)).all()


def _package_modules() -> dict[str, Path]:
    """Every module of dscale/ by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted((ROOT / "dscale").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(path: Path, modules: dict[str, Path]) -> set[str]:
    """The dscale modules ``path`` imports, anywhere in the file (``if TYPE_CHECKING:`` and
    function bodies included): ``from a import b`` is a.b where that is a module, else a."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if name in modules:
                    out.add(name)
                elif node.module in modules:
                    out.add(node.module)
    return out


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, or a module importing itself
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges[node]:
                    found.append(sorted(component))
    return found


def test_no_import_circle_anywhere_in_dscale() -> None:
    """A stage that imports the scaler back (even for a type) closes a circle: each module of
    dscale/ must be readable from the modules it imports, without the ones that import it."""
    modules = _package_modules()
    edges = {name: _targets(path, modules) - {name} for name, path in modules.items()}
    assert not _circles(edges), _circles(edges)


def test_the_circle_finder_finds_a_circle_of_three() -> None:
    # The negative control for the test above: a -> b -> c -> a is found, the tail d is not in it.
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(edges) == [["a", "b", "c"]]


def test_ls_dscale_reads_as_a_table_of_contents() -> None:
    """The public modules and one folder per concept: at most 15 entries, and no private module
    beside them but the one that owns the process groups (``_dist.py``)."""
    entries = sorted(p.name for p in (ROOT / "dscale").iterdir() if p.name != "__pycache__")
    assert len(entries) <= 15, entries
    private = [e for e in entries if e.startswith("_") and e not in ("__init__.py", "_dist.py")]
    assert not private, private
