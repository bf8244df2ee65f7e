"""End to end: torchrun restarts after a SIGKILL and the run ends exactly as an unbroken one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _torchrun(tmp: Path, name: str, kill_at: int) -> tuple[dict, dict]:
    env = {
        **os.environ,
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    out = tmp / f"{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        "--monitor-interval",
        "0.5",
        str(REPO / "tests/checkpoint/_elastic_train.py"),
        "--dir",
        str(tmp / name),
        "--out",
        str(out),
        "--steps",
        "9",
        "--kill-at",
        str(kill_at),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text()), torch.load(str(out) + ".pt", weights_only=True)


@pytest.mark.slow
def test_run_killed_by_sigkill_resumes_and_matches_an_uninterrupted_run_ddp(tmp_path):
    plain, plain_params = _torchrun(tmp_path, "plain", kill_at=0)
    killed, killed_params = _torchrun(tmp_path, "killed", kill_at=5)

    assert (tmp_path / "killed" / "killed-once").exists()
    assert killed["restart"] == 1 and plain["restart"] == 0
    assert killed["resumed_from"] == 4 and plain["resumed_from"] == 0
    assert killed["steps"] == plain["steps"] == 9
    assert killed["scale"] == plain["scale"]
    assert killed_params.keys() == plain_params.keys()
    for name, value in plain_params.items():
        assert torch.equal(killed_params[name], value), name
