"""The entrypoint is found from the folder the launcher starts in, under dscale-launch too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from launch.entrypoint import load_entrypoint


def test_entrypoint_in_the_current_folder_loads_without_it_on_sys_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The dscale-launch console script starts with its bin folder, not the current folder, on
    # sys.path (python -m launch has the current folder): the check before the workers start
    # must find the user's package all the same, as the workers do.
    pkg = tmp_path / "cwd_pkg_for_entrypoint"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("def main(ctx):\n    return 'ran'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_pkg_for_entrypoint", raising=False)
    assert load_entrypoint("cwd_pkg_for_entrypoint.train:main")(None) == "ran"
