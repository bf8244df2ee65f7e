"""Every function and method in dscale/ fits on a screen: at most 80 lines (issue 46 item 5).

Read from the source with ``ast`` (decorators and docstrings included), so a long
``GradScaler.__init__`` or a long stage fails here, not in review.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 80


def _too_long(path: Path, root: Path = ROOT) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = node.end_lineno - first + 1
            if length > LIMIT:
                out.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {length} lines")
    return out


def test_every_function_in_dscale_is_at_most_80_lines() -> None:
    long = [hit for path in sorted((ROOT / "dscale").rglob("*.py")) for hit in _too_long(path)]
    assert not long, long


def test_the_length_check_counts_a_long_function(tmp_path: Path) -> None:
    # The negative control: an 81-line function is reported, an 80-line one is not.
    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    (tmp_path / "m.py").write_text(f"def long():\n{body}\n    return 0\n\ndef fits():\n{body}\n")
    assert [h.split(" ")[1] for h in _too_long(tmp_path / "m.py", tmp_path)] == ["long:"]
