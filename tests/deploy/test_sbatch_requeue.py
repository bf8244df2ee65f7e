"""deploy/slurm/dscale.sbatch's requeue decision and message, under fake srun/scontrol (no root).

tests/deploy/test_slurm.py runs the same script on a real Slurm; this checks every exit status
in a second, where Slurm is not available.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dscale.checkpoint import PREEMPTED_EXIT_CODE
from tests.deploy._tools import DEPLOY

SBATCH = DEPLOY / "slurm" / "dscale.sbatch"


def _fake(bin_dir: Path, name: str, body: str) -> None:
    tool = bin_dir / name
    tool.write_text(f"#!/usr/bin/env bash\n{body}\n")
    tool.chmod(0o755)


def _run_script(tmp_path: Path, launcher_status: int, saved: list[int]) -> tuple[str, str, int]:
    bin_dir, calls, runs = tmp_path / "bin", tmp_path / "calls", tmp_path / "runs"
    bin_dir.mkdir()
    for step in saved:
        (runs / "4242" / "checkpoints" / f"step-{step}").mkdir(parents=True)
    _fake(bin_dir, "scontrol", f'echo "scontrol $*" >> {calls}; [[ $1 == show ]] && echo n1; true')
    _fake(
        bin_dir,
        "srun",
        f'if [[ "$*" == *hostname* ]]; then echo 10.0.0.1; else exit {launcher_status}; fi',
    )
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "1",
        "VENV": str(tmp_path / "venv"),
        "RUN_ROOT": str(runs),
    }
    proc = subprocess.run(
        ["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=30
    )
    log = calls.read_text() if calls.exists() else ""
    return log, proc.stdout + proc.stderr, proc.returncode


def test_sigterm_before_any_handler_exit_143_requeues_the_job(tmp_path):
    log, out, rc = _run_script(tmp_path, 143, saved=[])
    assert "scontrol requeue 4242" in log, out
    assert rc == 0, out


@pytest.mark.parametrize("status", [PREEMPTED_EXIT_CODE, 143])
def test_requeue_message_says_no_checkpoint_was_saved_when_none_was(tmp_path, status):
    log, out, _ = _run_script(tmp_path, status, saved=[])
    assert "scontrol requeue 4242" in log, out
    assert "a checkpoint was saved" not in out
    assert "no checkpoint in" in out and "starts from step 0" in out, out


def test_requeue_message_names_the_newest_checkpoint_it_resumes_from(tmp_path):
    _, out, _ = _run_script(tmp_path, PREEMPTED_EXIT_CODE, saved=[25, 100, 7])
    assert "it resumes from step 100" in out, out


@pytest.mark.parametrize("status", [1, 2, 137])
def test_other_failures_are_not_requeued(tmp_path, status):
    log, out, rc = _run_script(tmp_path, status, saved=[])
    assert "requeue" not in log, out
    assert rc == status


def test_output_is_appended_on_requeue_not_truncated():
    assert "#SBATCH --open-mode=append" in SBATCH.read_text()
