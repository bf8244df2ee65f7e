"""``make run`` installs what the job needs and nothing else (a newcomer's first command)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _dry_run(target: str, tmp_path: Path) -> str:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    venv = tmp_path / "venv"  # none yet: what a fresh clone's first run does
    # Under `make test` the outer make's MAKELEVEL/MAKEFLAGS would make this one a sub-make that
    # prints "Entering/Leaving directory" lines around its commands: run it as a user would.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", target, f"VENV={venv}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_run_installs_the_project_and_report_not_the_test_and_dev_extras(
    tmp_path: Path,
) -> None:
    out = _dry_run("run", tmp_path)
    installs = [line for line in out.splitlines() if "pip install" in line]
    # torch when missing, then the project with matplotlib for `python -m dscale.report`; the
    # old target installed .[test,dev] and timm (3 m 52 s of a 7-minute first run).
    assert [line.split("pip install")[1].split()[-1] for line in installs] == [
        '"torch==2.13.0"',
        '".[report]"',
    ], out
    assert out.splitlines()[-1].endswith("-m launch"), out
    assert "[test" in _dry_run("test", tmp_path)  # make test still installs them
