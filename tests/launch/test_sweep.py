"""A multirun (``-m``) is checked whole before its first job starts.

On i41d (4d7c75b) the launcher's own checks ran inside each job: ``-m fp8.recipe=tensorwise,rowwis``
trained job 0 to the end and then refused job 1 with status 2; ``-m trainer.precision=fp8,bf16
fp8.float8_all_gather=true`` trained the fp8 job and refused the bf16 one, though the key was typed
for the sweep's fp8 jobs; an Enum typo in a sweep got Hydra's message (status 1, no nearest value);
and ``-m model=glob(*)`` crashed in launch/typos.py with "ConfigLoader is not set".
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from hydra.core.global_hydra import GlobalHydra

import launch.app as launch_app
from launch.typos import misspelt_key


def _launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str, multirun: bool
) -> tuple[int, list[str]]:
    """``python -m launch [-m] OVERRIDES`` in this process: its exit status, and the precision
    of each job whose workers it would have started (none start)."""
    started: list[str] = []

    def workers(job: Any, plain: dict[str, Any], nproc: int, run_dir: Path) -> dict[int, Any]:
        started.append(plain["trainer"]["precision"])
        return {}  # no rank 0 here: the launcher writes no summary

    monkeypatch.setattr(launch_app, "_run", workers)
    head = ["-m", f"hydra.sweep.dir={tmp_path / 'sweep'}"] if multirun else []
    head += [f"hydra.run.dir={tmp_path / 'run'}", "metrics.enabled=false"]
    monkeypatch.setattr(sys, "argv", ["launch", *head, *overrides])
    GlobalHydra.instance().clear()
    try:
        launch_app.main()
    except SystemExit as exc:
        return int(exc.code or 0), started
    finally:
        GlobalHydra.instance().clear()
    return 0, started


@pytest.mark.parametrize(
    ("sweep", "later_job"),
    [
        (
            ["trainer.precision=fp8", "fp8.recipe=tensorwise,rowwis"],
            ["trainer.precision=fp8", "fp8.recipe=rowwis"],
        ),
        (["trainer.precision=fp16,fp4"], ["trainer.precision=fp4"]),
        (["model=mlp,gpt_small", "model.name=mlp"], ["model=gpt_small", "model.name=mlp"]),
    ],
)
def test_a_bad_value_in_a_later_job_of_a_sweep_is_refused_before_the_first_job_starts(
    sweep: list[str],
    later_job: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The oracle: the later job's values typed as a plain run, refused in the same words."""
    status, started = _launch(tmp_path, monkeypatch, *later_job, multirun=False)
    expected = capsys.readouterr().err.strip().splitlines()[0]
    assert (status, started) == (2, []), expected
    assert expected.startswith("dscale-launch: bad config: "), expected
    status, started = _launch(tmp_path, monkeypatch, *sweep, multirun=True)
    err = capsys.readouterr().err
    assert (status, started) == (2, []), err
    assert err.strip().splitlines()[0] == expected


def test_a_typed_key_that_no_job_of_a_sweep_reads_is_refused_before_any_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    typed = ["parallel=fsdp", "fp8.float8_all_gather=true"]
    status, started = _launch(
        tmp_path, monkeypatch, "trainer.precision=fp32,bf16", *typed, multirun=True
    )
    err = capsys.readouterr().err
    assert (status, started) == (2, []), err
    assert err.startswith(
        "dscale-launch: bad config: fp8.float8_all_gather=true is read only with "
        "trainer.precision=fp8"
    ), err
    assert err.rstrip().endswith("(in every job of this multirun)"), err


def test_a_typed_key_that_some_jobs_of_a_sweep_read_runs_every_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fp8.*`` typed for a sweep over the precision is for its fp8 jobs: each job runs once."""
    typed = ["parallel=fsdp", "fp8.float8_all_gather=true"]
    status, started = _launch(
        tmp_path, monkeypatch, "trainer.precision=fp8,bf16", *typed, multirun=True
    )
    assert (status, started) == (0, ["fp8", "bf16"]), capsys.readouterr().err
    # A plain bf16 run with the same key is still refused (the sweep's allowance does not stay).
    status, started = _launch(
        tmp_path, monkeypatch, "trainer.precision=bf16", *typed, multirun=False
    )
    assert (status, started) == (2, []), capsys.readouterr().err


def test_a_glob_sweep_is_left_to_hydras_sweeper() -> None:
    """``-m model=glob(*)`` needs Hydra's config loader to expand: neither check raises."""
    argv = ["-m", "model=glob(*)"]
    assert misspelt_key(argv, launch_app.CONFIG_DIR, "job") is None
    from launch.sweep import sweep_problem

    assert sweep_problem(argv, launch_app.CONFIG_DIR, "job") is None
