"""Find the system tools the deploy tests need; a missing tool fails the test, it never skips."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"


def require_tool(name: str) -> str:
    """Path of ``name``, or a test failure saying how to install it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} not found: run `bash .ci/run` or `apt-get install "
            f"{'yamllint' if name == 'yamllint' else 'prometheus'}`",
            pytrace=False,
        )
    return path


def run_tool(*args: str, cwd: Path | None = None, stdin: str | None = None) -> str:
    """Run a tool; on a non-zero exit fail with its full output."""
    proc = subprocess.run(
        list(args), cwd=cwd, input=stdin, capture_output=True, text=True, timeout=120
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{output}"
    return output
