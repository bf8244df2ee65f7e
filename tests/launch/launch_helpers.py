"""Run ``python -m launch`` in a subprocess, the way a user does, and read what it left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"

# Keep test jobs small and off the default metrics ports, which a real run may hold.
FAST = ["trainer.log_every=5", "checkpoint.every=5", "data.seq_len=32"]


def launch(
    run_dir: Path, *overrides: str, timeout_s: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m launch hydra.run.dir=RUN_DIR OVERRIDES``; bounded by ``timeout_s``."""
    flags = [o for o in overrides if o.startswith("-")]  # argparse wants -m before overrides
    rest = [o for o in overrides if not o.startswith("-")]
    cmd = [sys.executable, "-m", "launch", *flags, f"hydra.run.dir={run_dir}", *rest]
    # Own session, so a timeout ends the workers too, not only the launcher.
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"python -m launch did not finish in {timeout_s:.0f} s\n{stdout}\n{stderr}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return f"rc={proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def worker_config(run_dir: Path, rank: int) -> dict[str, Any]:
    """The resolved config that rank ``rank`` received."""
    return json.loads((run_dir / "logs" / f"rank{rank}.config.json").read_text())


def skipped_in_metrics_log(run_dir: Path, rank: int) -> list[int]:
    """Steps that ``dscale.metrics.MetricsLog`` recorded as skipped on ``rank``."""
    lines = (run_dir / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return sorted({r["step"] for r in rows if r["skipped"]})
