"""The real job under the real launcher, shortened: python -m launch in a subprocess."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from launch_helpers import (
    FAST,
    free_port_pair,
    launch,
    output,
    skipped_in_metrics_log,
    summary,
    worker_config,
)

pytestmark = pytest.mark.slow


def _skips_in_rank_log(run_dir: Path, rank: int) -> list[int]:
    text = (run_dir / "logs" / f"rank{rank}.log").read_text()
    return [int(s) for s in re.findall(r"step (\d+) skipped", text)]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_job_runs_and_every_rank_skips_the_step_where_only_rank_1_overflowed(
    parallel: str, tmp_path: Path
) -> None:
    proc = launch(
        tmp_path,
        *FAST,
        f"parallel={parallel}",
        "trainer.max_steps=30",
        "scaler.growth_interval=7",  # an override the workers must see
        "fault.inf_steps=[4,11]",
        "fault.inf_rank=1",
        f"metrics.port={free_port_pair()}",
        f"metrics.targets_dir={tmp_path / 'targets'}",
    )
    assert proc.returncode == 0, output(proc)
    # file_sd targets were published for the run and removed after a normal end.
    assert (tmp_path / "targets").is_dir()
    assert list((tmp_path / "targets").iterdir()) == []
    s = summary(tmp_path)
    assert (s["world_size"], s["steps"], s["resumed_from"]) == (2, 30, None)
    assert [r["rank"] for r in s["ranks"]] == [0, 1]
    assert [r["skipped_steps"] for r in s["ranks"]] == [[4, 11], [4, 11]]
    assert s["ranks"][0]["final_scale"] == s["ranks"][1]["final_scale"]
    assert s["result"]["final_loss"] < s["result"]["first_loss"]
    assert s["result"]["tokens_per_s"] > 0
    # The same skipped steps in each rank's own log and in dscale's metrics log.
    assert _skips_in_rank_log(tmp_path, 0) == _skips_in_rank_log(tmp_path, 1) == [4, 11]
    # dscale's MetricsLog keeps the scaler's 0-based iteration index: steps 4 and 11 are 3 and 10.
    assert skipped_in_metrics_log(tmp_path, 0) == skipped_in_metrics_log(tmp_path, 1) == [3, 10]
    for rank in (0, 1):
        seen = worker_config(tmp_path, rank)
        assert seen["scaler"]["growth_interval"] == 7
        assert seen["trainer"]["max_steps"] == 30
        assert seen["parallel"]["strategy"] == parallel
    # One run folder: Hydra's files, the resolved config, logs and checkpoints inside it.
    assert (tmp_path / ".hydra" / "config.yaml").is_file()
    assert (tmp_path / "config.resolved.yaml").is_file()
    assert (tmp_path / "checkpoints" / "step-30").is_dir()
    assert "summary.json" in proc.stdout


def test_job_survives_repeated_sigkill_and_resumes_from_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    # Rank 1 SIGKILLs itself at step 12 in attempts 0, 1 and 2; attempt 3 finishes. Each
    # attempt resumes from step-10, so this also shows that a gloo group re-forms every time.
    proc = launch(
        tmp_path,
        *FAST,
        "model=mlp",
        "trainer.max_steps=20",
        "fault.inf_steps=[3]",
        "fault.kill_step=12",
        "fault.kill_attempts=3",
        "launcher.max_restarts=3",
        "metrics.enabled=false",
        timeout_s=420,
    )
    assert proc.returncode == 0, output(proc)
    s = summary(tmp_path)
    assert (s["steps"], s["resumed_from"], s["restarts"]) == (20, 10, 3)
    # Step 3 was skipped in attempt 0; the record came back from the checkpoint.
    assert [r["skipped_steps"] for r in s["ranks"]] == [[3], [3]]
    kills = (tmp_path / "logs" / "rank1.log").read_text().count("SIGKILL of this rank at step 12")
    assert kills == 3


def test_multirun_runs_one_job_after_another(tmp_path: Path) -> None:
    proc = launch(
        tmp_path / "unused",
        "-m",
        f"hydra.sweep.dir={tmp_path}",
        *FAST,
        "model=mlp",
        "trainer.max_steps=6",
        "metrics.enabled=false",
        "scaler.growth_interval=100,1000",
    )
    assert proc.returncode == 0, output(proc)
    seen = {}
    for job in ("0", "1"):
        assert summary(tmp_path / job)["steps"] == 6
        seen[job] = worker_config(tmp_path / job, 1)["scaler"]["growth_interval"]
    assert seen == {"0": 100, "1": 1000}


def test_one_runs_log_numbers_steps_from_1_in_progress_faults_skips_summary_and_checkpoints(
    tmp_path: Path,
) -> None:
    # fault.inf_steps=[4,10] is the 4th and the 10th step. Old code injected at 0-based indices
    # (the 5th and 11th steps), logged them as "step 4 skipped", while the progress line of the
    # same step said "step 5/12 ... skipped 1" and step-4 held 4 steps.
    proc = launch(
        tmp_path,
        *FAST,
        "model=mlp",
        "trainer.max_steps=12",
        "trainer.log_every=1",
        "checkpoint.every=4",
        "checkpoint.keep=3",
        "fault.inf_steps=[4,10]",
        "metrics.enabled=false",
    )
    assert proc.returncode == 0, output(proc)
    rank0 = (tmp_path / "logs" / "rank0.log").read_text()
    progress = [(int(n), int(k)) for n, k in re.findall(r"step (\d+)/12 .* skipped (\d+)", rank0)]
    assert [n for n, _ in progress] == list(range(1, 13)), rank0
    # The progress line of step N counts the skips of steps 1..N, so the numbers are the same.
    assert progress == [(n, (n >= 4) + (n >= 10)) for n in range(1, 13)], progress
    rank1 = (tmp_path / "logs" / "rank1.log").read_text()
    injected = re.findall(r"inf injected into this rank's gradients at step (\d+)", rank1)
    assert injected == ["4", "10"], rank1
    assert _skips_in_rank_log(tmp_path, 0) == _skips_in_rank_log(tmp_path, 1) == [4, 10]
    assert [r["skipped_steps"] for r in summary(tmp_path)["ranks"]] == [[4, 10], [4, 10]]
    # step-N holds the state after step N (N steps done).
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["step-12", "step-4", "step-8"], saved
