"""Preemption: SIGTERM makes every rank finish its step and save; the restart resumes there.

The end-to-end test runs the real launcher (``python -m launch``, 2 gloo ranks) three times:
uninterrupted; preempted by SIGTERM to the launcher at a random step, with periodic checkpoints
far apart; and restarted. The oracle is the uninterrupted run's final checkpoint, compared bit
for bit.
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dscale.checkpoint import PREEMPTED_EXIT_CODE, CheckpointManager, PreemptionGuard
from tests.checkpoint._helpers import make_model, make_scaler
from tests.launch.launch_helpers import launch, output, summary

REPO = Path(__file__).resolve().parents[2]
JOB = [
    "model=mlp",
    "data.seq_len=32",
    "trainer.log_every=50",
    "trainer.max_steps=150",
    "checkpoint.every=1000",  # far apart: only the preemption and final saves happen
    "metrics.enabled=false",
    "launcher.max_restarts=0",
]


def _final_state(ckpt: Path, step: int) -> dict:
    out = ckpt.parent / f"{ckpt.name}-step-{step}.pt"
    dcp_to_torch_save(ckpt / f"step-{step}", out)
    return torch.load(out, weights_only=False)


# Python's own ``random`` is not seeded by the launcher and not used by training, so each run
# starts it differently; everything else (torch's RNG included) must match bit for bit.
UNSEEDED = {".train.rng.python", ".train.rng.python_gauss"}


def _assert_bit_identical(got, want, where: str = "") -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            if f"{where}.{key}" not in UNSEEDED:
                _assert_bit_identical(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    else:
        assert got == want, where


@pytest.mark.slow
def test_sigterm_saves_on_every_rank_and_the_restart_ends_bit_identical_ddp(tmp_path):
    preempt_at = random.randint(5, 50)
    note = f"(SIGTERM at step {preempt_at})"
    plain = launch(tmp_path / "plain", *JOB, f"checkpoint.dir={tmp_path / 'plain-ckpt'}")
    assert plain.returncode == 0, output(plain)

    ckpt = tmp_path / "ckpt"
    first = launch(
        tmp_path / "first", *JOB, f"checkpoint.dir={ckpt}", f"fault.preempt_step={preempt_at}"
    )
    assert first.returncode == PREEMPTED_EXIT_CODE, note + output(first)
    saved = [int(p.name[5:]) for p in ckpt.iterdir() if re.fullmatch(r"step-\d+", p.name)]
    assert len(saved) == 1 and preempt_at <= saved[0] < 150, (saved, note)
    for rank in (0, 1):  # every rank stopped after the same step and saved it
        log = (tmp_path / "first" / "logs" / f"rank{rank}.log").read_text()
        assert f"preempted: saved a checkpoint at step {saved[0]}" in log, note

    second = launch(tmp_path / "second", *JOB, f"checkpoint.dir={ckpt}")
    assert second.returncode == 0, note + output(second)
    assert summary(tmp_path / "second")["resumed_from"] == saved[0], note
    _assert_bit_identical(_final_state(ckpt, 150), _final_state(tmp_path / "plain-ckpt", 150))


@pytest.mark.parametrize("mode", ["second-signal", "kill"])
def test_second_signal_or_kill_during_the_preemption_save_keeps_the_previous_checkpoint(
    tmp_path, mode
):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.checkpoint._preempted_save", mode, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    names = sorted(p.name for p in tmp_path.iterdir())
    if mode == "second-signal":  # ignored: the save finishes, the job exits restartable
        assert proc.returncode == PREEMPTED_EXIT_CODE, proc.stderr[-3000:]
        assert "saved step 6 after 2 signals" in proc.stdout
        assert names == ["step-2", "step-6"]
    else:  # killed mid-write: the unfinished folder is never published
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        assert names == [".step-6.tmp", "step-2"]
    model = make_model(seed=9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_scaler()
    resumed = CheckpointManager(tmp_path).resume("auto", model=model, optimizer=opt, scaler=scaler)
    assert resumed == (6 if mode == "second-signal" else 2)
    previous = CheckpointManager(tmp_path).load(tmp_path / "step-2", model=model, optimizer=opt)
    assert previous == 2


def test_guard_refuses_unknown_or_unhandleable_signals_and_restores_handlers():
    with pytest.raises(ValueError, match="SIGNOPE"):
        PreemptionGuard(["SIGNOPE"])
    with pytest.raises(ValueError, match="SIGKILL"):
        PreemptionGuard(["SIGKILL"])
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionGuard(["USR1"]) as guard:
        assert not guard.should_stop()
        signal.raise_signal(signal.SIGUSR1)
        assert guard.should_stop() and guard.received == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is before


def _fake(bin_dir: Path, name: str, body: str) -> None:
    tool = bin_dir / name
    tool.write_text(f"#!/usr/bin/env bash\n{body}\n")
    tool.chmod(0o755)


@pytest.mark.parametrize(("launcher_status", "requeued"), [(PREEMPTED_EXIT_CODE, True), (1, False)])
def test_slurm_script_requeues_itself_when_the_job_was_preempted(
    tmp_path, launcher_status, requeued
):
    """The script under fake srun/scontrol: dscale-launch exits 75 -> scontrol requeue."""
    script = REPO / "deploy" / "slurm" / "dscale.sbatch"
    text = script.read_text()
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=TERM@" in text
    assert f"PREEMPTED_EXIT_CODE={PREEMPTED_EXIT_CODE}" in text
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    scontrol = f'echo "scontrol $*" >> {calls}; [[ $1 == show ]] && echo node1; true'
    _fake(bin_dir, "scontrol", scontrol)
    # srun: the first call resolves the head node's address, the second runs dscale-launch.
    _fake(
        bin_dir,
        "srun",
        f'echo "srun $*" >> {calls}; if [[ "$*" == *hostname* ]]; then echo 10.0.0.1; '
        f"else exit {launcher_status}; fi",
    )
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "1",
        "VENV": str(tmp_path / "venv"),
        "RUN_ROOT": str(tmp_path / "runs"),
    }
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    log = calls.read_text()
    assert ("scontrol requeue 4242" in log) == requeued, log + proc.stderr
    assert proc.returncode == (0 if requeued else launcher_status), proc.stderr
