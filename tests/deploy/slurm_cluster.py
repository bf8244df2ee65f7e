"""A one-node Slurm cluster under a temp folder, for running deploy/slurm/dscale.sbatch for real.

munged, ``slurmctld -D`` and ``slurmd -D -N localhost`` run as root from a generated slurm.conf
(``SLURM_CONF``), on free ports of 127.0.0.1, with no cgroups (``proctrack/linuxproc``,
``task/none``). ``cred_expire=5`` lets a requeued job start again after 5 s instead of 120 s.
Two partitions share the node: ``batch`` (the default; its jobs are requeued when preempted, after
``GraceTime`` seconds with SIGTERM) and ``urgent``, whose jobs preempt them.

Everything is stopped by PID: the jobs' processes first (found by the cluster folder in their
environment), then the three daemons.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.ports import free_port

PREEMPT_GRACE_S = 30

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue")

_CONF = """\
ClusterName=dscaletest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire=5
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobRequeue=1
ReturnToService=2
MinJobAge=600
KillWait=10
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=batch Nodes=localhost Default=YES MaxTime=INFINITE State=UP PriorityTier=1 \
PreemptMode=REQUEUE GraceTime={grace}
PartitionName=urgent Nodes=localhost MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def wait_for(what: str, check: Callable[[], object], timeout_s: float, every_s: float = 0.2):
    """Poll ``check`` until it returns something truthy; fail naming ``what`` after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(every_s)


class SlurmCluster:
    """munged + slurmctld + slurmd under ``root``; ``env`` is what Slurm's clients need."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: list[tuple[str, subprocess.Popen[bytes]]] = []

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, timeout_s: float = 30) -> None:
        for sub in ("munge", "state", "spool", "logs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(
            _CONF.format(
                host=os.uname().nodename,
                root=self.root,
                ctld_port=free_port(),
                slurmd_port=free_port(),
                cpus=os.cpu_count() or 1,
                grace=PREEMPT_GRACE_S,
            )
        )
        munge_dir = self.root / "munge"
        self._spawn(
            "munged",
            ["munged", "-F", "-f", f"--socket={munge_dir}/munge.socket",
             f"--key-file={key}", f"--pid-file={munge_dir}/munged.pid",
             f"--log-file={munge_dir}/munged.log", f"--seed-file={munge_dir}/munged.seed"],
        )  # fmt: skip
        wait_for("munged socket", (munge_dir / "munge.socket").exists, timeout_s)
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", ["slurmd", "-D", "-N", "localhost", "-f", str(self.conf)])
        wait_for(
            "the Slurm node to become idle",
            lambda: "idle" in self.run("sinfo", "-h", "-o", "%T", check=False),
            timeout_s,
        )

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "logs" / f"{name}.out", "wb")  # noqa: SIM115 - kept for the daemon
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        self._daemons.append((name, proc))
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited at once: {self.logs()}")

    def stop(self) -> None:
        """Cancel every job, end the jobs' processes, then the daemons; each by PID."""
        with contextlib.suppress(Exception):
            self.run("scancel", "--full", "--user=root", check=False, timeout_s=10)
        for pid in self._job_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for _, proc in reversed(self._daemons):
            if proc.poll() is None:
                proc.terminate()
        for _, proc in reversed(self._daemons):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._daemons.clear()
        for pid in self._job_pids():  # slurmstepd may have started a task while we stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _job_pids(self) -> list[int]:
        """Processes whose environment names this cluster's slurm.conf: the jobs and steps."""
        mine = f"SLURM_CONF={self.conf}".encode()
        daemons = {p.pid for _, p in self._daemons} | {os.getpid()}
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in daemons:
                continue
            try:
                if mine not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid not in daemons:  # slurmctld's own helper (slurmscriptd) ends with it
                pids.append(int(entry.name))
        return pids

    def step_catches_sigterm(self, job_id: int, step: int) -> int | None:
        """A process of step ``job_id.step`` with a SIGTERM handler installed (its pid), if any.

        A signal sent before the step's task exists, or before its program installed a handler,
        is not one the program could act on: Slurm drops it, or the default action runs.
        """
        wanted = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_STEP_ID={step}".encode()}
        for pid in self._job_pids():
            try:
                env = set((Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0"))
                status = (Path("/proc") / str(pid) / "status").read_text()
            except OSError:
                continue
            caught = next(
                (ln.split()[1] for ln in status.splitlines() if ln.startswith("SigCgt")), "0"
            )
            if wanted <= env and int(caught, 16) & (1 << (signal.SIGTERM - 1)):
                return pid
        return None

    def logs(self) -> str:
        """The daemons' logs, for a failure message."""
        parts = []
        for path in sorted([*self.root.glob("*.log"), *(self.root / "logs").glob("*")]):
            text = path.read_text(errors="replace")
            parts.append(f"--- {path.name} (last 3000 chars)\n{text[-3000:]}")
        return "\n".join(parts)

    # -- clients -------------------------------------------------------------------------------
    def run(self, *cmd: str, check: bool = True, timeout_s: float = 30) -> str:
        proc = subprocess.run(
            list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout_s
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr}")
        return proc.stdout

    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> int:
        """Submit; return the job id. ``env`` adds variables the job inherits (``--export=ALL``)."""
        out = subprocess.run(
            ["sbatch", "--parsable", *args],
            env={**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} exited {out.returncode}: {out.stderr}")
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def steps(self, job_id: int) -> list[str]:
        out = self.run("squeue", "-h", "-s", "-j", str(job_id), "-o", "%i", check=False)
        return out.split()

    def wait_job(self, job_id: int, states: set[str], timeout_s: float) -> dict[str, str]:
        return wait_for(
            f"job {job_id} reaching {sorted(states)}",
            lambda: (info := self.job(job_id)).get("JobState") in states and info,
            timeout_s,
        )


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
