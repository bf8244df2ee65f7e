"""Run ``python -m launch`` in a subprocess, the way a user does, and read what it left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.ports import free_port, free_port_pair  # noqa: F401 - re-exported for tests

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
EXAMPLE = ROOT / "examples" / "tiny_regression"
HERE = Path(__file__).resolve().parent

# Keep test jobs small and off the default metrics ports, which a real run may hold.
FAST = ["trainer.log_every=5", "checkpoint.every=5", "data.seq_len=32"]


class Launched:
    """A running ``python -m launch`` in its own session; its output goes to files."""

    def __init__(
        self,
        run_dir: Path,
        *overrides: str,
        cwd: Path = ROOT,
        env: dict[str, str] | None = None,
    ) -> None:
        flags = [o for o in overrides if o.startswith("-")]  # argparse wants -m before overrides
        rest = [o for o in overrides if not o.startswith("-")]
        self.cmd = [sys.executable, "-m", "launch", *flags, f"hydra.run.dir={run_dir}", *rest]
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self._out = run_dir.parent / f"{run_dir.name}.stdout"
        self._err = run_dir.parent / f"{run_dir.name}.stderr"
        with open(self._out, "w") as out, open(self._err, "w") as err:
            # Own session, so a timeout ends the workers too, not only the launcher.
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=cwd,
                stdout=out,
                stderr=err,
                text=True,
                # These are CPU jobs on gloo on any host: on a GPU host `auto` would pick one
                # rank per GPU and NCCL instead (a test may still ask for CUDA through env).
                env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})},
                start_new_session=True,
            )

    def running(self) -> bool:
        return self.proc.poll() is None

    def finish(self, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        """Wait for the launcher (killing its session after ``timeout_s``); return its output."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(
                f"python -m launch did not finish in {timeout_s:.0f} s\n"
                f"{self._out.read_text()}\n{self._err.read_text()}"
            ) from None
        return subprocess.CompletedProcess(
            self.cmd, self.proc.returncode, self._out.read_text(), self._err.read_text()
        )

    def kill(self) -> None:
        if self.running():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def launch(
    run_dir: Path,
    *overrides: str,
    timeout_s: float = 300,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m launch hydra.run.dir=RUN_DIR OVERRIDES``; bounded by ``timeout_s``."""
    return Launched(run_dir, *overrides, cwd=cwd, env=env).finish(timeout_s)


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


def leftover_workers(run_dir: Path) -> list[str]:
    """Processes still alive that the launcher started for ``run_dir`` (it marks their env).

    multiprocessing's resource tracker is not a worker: it leaves on its own once the
    launcher's pipe closes. Nor is a process already exiting (state Z or X, or no command line
    left: the kernel clears it while tearing the process down), which a loaded machine can show
    for a moment after the launcher returned.
    """
    marker = f"DSCALE_RUN_DIR={run_dir}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):  # gone meanwhile, or not ours
            continue
        exiting = state in ("Z", "X") or not cmdline.strip()
        if marker in env and "resource_tracker" not in cmdline and not exiting:
            found.append(f"{proc.name}: {cmdline}")
    return found


def wait_until(what: str, check: Any, launched: list[Launched], deadline_s: float = 240) -> Any:
    """Poll ``check()`` until it returns something truthy; fail early if a launcher ended."""
    deadline = time.monotonic() + deadline_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as exc:  # not listening yet
            last = exc
        if last and not isinstance(last, Exception):
            return last
        for job in launched:
            if not job.running():
                raise AssertionError(f"the launcher ended while waiting for {what}: {last!r}")
        time.sleep(0.2)  # a poll interval, not a synchronisation
    raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what}: {last!r}")
