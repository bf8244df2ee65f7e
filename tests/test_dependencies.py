"""What a plain ``pip install dscale`` (and ``make run``'s install) brings, and why."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
WARNING = "Failed to initialize NumPy"


def _core_requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0].lower() for r in project["dependencies"]]


def test_numpy_is_installed_with_dscale_itself_so_torch_imports_without_a_warning() -> None:
    """Without NumPy, every ``import torch`` (each rank of make run) prints torch's warning."""
    blocked = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['numpy'] = None; import torch"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert WARNING in blocked.stderr  # the oracle: what a venv without NumPy prints
    assert "numpy" in _core_requirements()
    with_numpy = subprocess.run(
        [sys.executable, "-c", "import torch"], capture_output=True, text=True, timeout=120
    )
    assert WARNING not in with_numpy.stderr
