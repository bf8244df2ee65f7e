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
