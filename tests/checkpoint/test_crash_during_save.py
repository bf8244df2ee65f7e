"""A process killed between writing and publishing a checkpoint leaves the previous one usable."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import torch

from dscale.checkpoint import CheckpointManager
from tests.checkpoint._helpers import make_model, make_scaler, params, train

REPO = Path(__file__).resolve().parents[2]


def test_sigkill_before_publish_keeps_previous_checkpoint_loadable(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.checkpoint._crash_before_publish", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    # Step 2 was fully written (DCP wrote .metadata) but never published.
    assert (tmp_path / ".step-2.tmp" / ".metadata").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-2.tmp", "step-1"]

    model = make_model(seed=9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_scaler(init_scale=8.0)
    ckpt = CheckpointManager(tmp_path, keep=2)
    assert ckpt.resume("auto", model=model, optimizer=opt, scaler=scaler) == 1

    expected = make_model()
    train(expected, torch.optim.SGD(expected.parameters(), lr=0.1), make_scaler(), 2)
    for name, value in params(expected).items():
        assert torch.equal(params(model)[name], value), name
    # The next save clears the leftover and publishes normally.
    ckpt.save(2, model=model, optimizer=opt, scaler=scaler)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]
