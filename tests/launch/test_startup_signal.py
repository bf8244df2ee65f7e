"""A SIGTERM in the launcher's first instant (Slurm preempting a step that just started) is handled.

Before, ``dscale-launch`` had no SIGTERM handler until torchelastic started the workers, seconds
after the start; a SIGTERM before that ended it with 143 and the Slurm job FAILED.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dscale.checkpoint import PREEMPTED_EXIT_CODE
from tests.launch.launch_helpers import ROOT


def _catches_sigterm(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def _torch_loaded(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_sigterm_before_torch_has_loaded_exits_75_without_starting_workers(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch", f"hydra.run.dir={run_dir}", "launcher.nproc_per_node=2",
         f"checkpoint.dir={tmp_path / 'ckpt'}", "metrics.enabled=false"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _catches_sigterm(proc.pid):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the launcher never handled SIGTERM"
            time.sleep(0.005)
        torch_loaded = _torch_loaded(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not torch_loaded, "SIGTERM was not handled until torch had loaded (seconds after start)"
    assert proc.returncode == PREEMPTED_EXIT_CODE, out + err
    assert "stopped by SIGTERM before any worker started" in err, err
    assert not (run_dir / "logs").exists()  # no worker ran
