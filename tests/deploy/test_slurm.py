"""deploy/slurm/dscale.sbatch, unmodified, on a real one-node Slurm (tests/deploy/slurm_cluster.py).

Only command-line adjustments are passed to sbatch (one node, 2 CPUs, no GPUs, 2 local ranks, a
small job); the script itself is the file users copy. One cluster serves the whole module. The
oracle for every interrupted run is the uninterrupted run's final checkpoint, compared bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from dscale.checkpoint import PREEMPTED_EXIT_CODE
from tests.checkpoint.test_preemption import _assert_bit_identical, _final_state
from tests.deploy._tools import DEPLOY
from tests.deploy.slurm_cluster import SlurmCluster, missing_tools, wait_for
from tests.ports import free_port

SBATCH = DEPLOY / "slurm" / "dscale.sbatch"
MAX_STEPS = 120
JOB = [
    "launcher.nproc_per_node=2",
    "model=mlp",
    "data.seq_len=32",
    f"trainer.max_steps={MAX_STEPS}",
    "trainer.log_every=10",
    "checkpoint.every=1000",  # only the preemption save and the final one
    "metrics.enabled=false",
]
# What a one-node, CPU-only cluster needs instead of the script's 2 nodes x 8 GPUs.
SBATCH_ARGS = ["--nodes=1", "--cpus-per-task=2", "--gpus-per-node=0"]
JOB_TIMEOUT_S = 180

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the Slurm daemons (munged, slurmctld, slurmd) need root; run as root or in CI")
    missing = missing_tools()
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not found: `make test` installs Debian's slurm-wlm, slurmctld, "
            "slurmd and munge (make system-tools), or `apt-get install slurm-wlm slurmctld slurmd "
            "munge`",
            pytrace=False,
        )
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


class Job:
    """One submission of the sbatch script: its id, output file, run and checkpoint folders."""

    def __init__(self, slurm: SlurmCluster, root: Path, *overrides: str) -> None:
        self.slurm = slurm
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        env = {
            "VENV": str(Path(sys.executable).parent.parent),
            "RUN_ROOT": str(root / "runs"),
            "RDZV_PORT": str(free_port()),
        }
        self.id = slurm.sbatch(
            *SBATCH_ARGS, f"--output={root}/job-%j.out", str(SBATCH), *JOB, *overrides,
            cwd=root, env=env,
        )  # fmt: skip
        self.out = root / f"job-{self.id}.out"
        self.checkpoints = root / "runs" / str(self.id) / "checkpoints"
        self.run_dir = root / "runs" / str(self.id) / "node0"

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def wait_for_step(self, step: int) -> None:
        wait_for(
            f"job {self.id} logging step {step}",
            lambda: f"step {step}/{MAX_STEPS}" in self.output() or self._ended(),
            JOB_TIMEOUT_S,
        )
        assert f"step {step}/{MAX_STEPS}" in self.output(), self.report()

    def _ended(self) -> bool:
        return self.slurm.job(self.id).get("JobState") in {"COMPLETED", "FAILED", "CANCELLED"}

    def wait_done(self) -> dict[str, str]:
        try:
            return self.slurm.wait_job(
                self.id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, JOB_TIMEOUT_S
            )
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.report()}") from None

    def summary(self) -> dict:
        path = self.run_dir / "summary.json"
        if not path.exists():  # say what the job did, not only which file is missing
            raise AssertionError(f"{path} was not written" + self.report())
        return json.loads(path.read_text())

    def saved_steps(self) -> list[int]:
        return sorted(
            int(p.name[5:]) for p in self.checkpoints.iterdir() if re.fullmatch(r"step-\d+", p.name)
        )

    def report(self) -> str:
        return (
            f"\n--- scontrol show job {self.id}\n{self.slurm.job(self.id)}\n"
            f"--- {self.out.name}\n{self.output()[-6000:]}\n{self.slurm.logs()[-4000:]}"
        )


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory) -> Job:
    job = Job(slurm, tmp_path_factory.mktemp("uninterrupted"))
    job.wait_done()
    return job


def test_unmodified_sbatch_script_runs_a_2_rank_job_to_completion(uninterrupted):
    job = uninterrupted
    info = job.slurm.job(job.id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job.report()
    assert info["Restarts"] == "0", job.report()
    summary = job.summary()
    assert [r["rank"] for r in summary["ranks"]] == [0, 1], summary
    assert all(r["steps"] == MAX_STEPS for r in summary["ranks"]), summary
    assert job.saved_steps() == [MAX_STEPS]


def _assert_resumed_like_uninterrupted(job: Job, uninterrupted: Job, after_step: int) -> None:
    info = job.slurm.job(job.id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job.report()
    assert int(info["Restarts"]) >= 1, "the job was never requeued" + job.report()
    resumed_from = job.summary()["resumed_from"]
    assert resumed_from is not None and after_step <= resumed_from < MAX_STEPS, job.report()
    for rank in (0, 1):  # every rank saved that step and exited 75 before the requeue
        log = (job.run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"preempted: saved a checkpoint at step {resumed_from}" in log, job.report()
        assert f"exiting with status {PREEMPTED_EXIT_CODE}" in log, job.report()
    _assert_bit_identical(
        _final_state(job.checkpoints, MAX_STEPS), _final_state(uninterrupted.checkpoints, MAX_STEPS)
    )


def test_sigterm_mid_run_checkpoints_exits_75_requeues_and_resumes_like_an_uninterrupted_run(
    slurm, uninterrupted, tmp_path
):
    job = Job(slurm, tmp_path)
    job.wait_for_step(20)
    slurm.run("scancel", "--signal=TERM", str(job.id))  # the job's steps, as --signal=TERM@ does
    job.wait_done()
    _assert_resumed_like_uninterrupted(job, uninterrupted, after_step=20)
    step = job.summary()["resumed_from"]
    # Both attempts' output, and a requeue message that names the step it resumes from.
    assert f"requeueing job {job.id}; it resumes from step {step}" in job.output(), job.report()
    assert job.output().count("dscale: 1 nodes, rendezvous on") == 2, job.report()


def test_partition_preemption_checkpoints_requeues_and_resumes_like_an_uninterrupted_run(
    slurm, uninterrupted, tmp_path
):
    job = Job(slurm, tmp_path)
    job.wait_for_step(20)
    # A job in the higher-priority partition that needs the whole node preempts ours: Slurm
    # sends SIGTERM, waits up to GraceTime, then requeues it.
    urgent = slurm.sbatch(
        "--partition=urgent", "--exclusive", f"--output={tmp_path}/urgent-%j.out", "--wrap=true",
        cwd=tmp_path,
    )  # fmt: skip
    slurm.wait_job(urgent, {"COMPLETED"}, JOB_TIMEOUT_S)
    job.wait_done()
    assert job.slurm.job(urgent)["ExitCode"] == "0:0"
    _assert_resumed_like_uninterrupted(job, uninterrupted, after_step=20)


def test_sigterm_in_the_first_second_of_the_job_step_is_not_lost_and_output_survives_requeue(
    slurm, uninterrupted, tmp_path
):
    job = Job(slurm, tmp_path)
    # Step 0 resolves the head node's address; step 1 is dscale-launch. The signal goes out the
    # moment its first handler is in place (before torch and Hydra load): a signal sent before
    # the process exists is dropped by Slurm, and none can be handled before a handler is set.
    catching = f"step {job.id}.1 catching SIGTERM"
    pid = wait_for(catching, lambda: slurm.step_catches_sigterm(job.id, 1), JOB_TIMEOUT_S, 0.01)
    loaded = (Path("/proc") / str(pid) / "maps").read_text()
    slurm.run("scancel", "--signal=TERM", str(job.id))
    assert "libtorch" not in loaded, "the launcher caught SIGTERM only once torch had loaded"
    info = job.wait_done()
    assert info["JobState"] == "COMPLETED", "the early SIGTERM ended the job" + job.report()
    assert int(info["Restarts"]) >= 1, job.report()
    text = job.output()
    # --open-mode=append: the first attempt's lines are still there after the requeue.
    assert text.count("dscale: 1 nodes, rendezvous on") == 2, job.report()
    # Nothing was saved before the signal, and the requeue message must not claim otherwise.
    assert "a checkpoint was saved" not in text, job.report()
    assert f"requeueing job {job.id}; no checkpoint in {job.checkpoints} yet" in text, job.report()
    assert job.summary()["resumed_from"] is None, job.report()
    _assert_bit_identical(
        _final_state(job.checkpoints, MAX_STEPS), _final_state(uninterrupted.checkpoints, MAX_STEPS)
    )
