"""Nothing lost between runs: the same command resumes, and an unusable folder fails first.

A preempted or crashed job is rerun by typing the same command again. Before, each run got a
new timestamped folder, so ``checkpoint.resume=auto`` found nothing and training started over
while the exit message said it would resume.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from launch_helpers import CONFIGS, ROOT, output
from omegaconf import OmegaConf

from dscale.checkpoint import PREEMPTED_EXIT_CODE, CheckpointManager
from launch.rerun import check_same_job, world_size_change
from launch.schema import JobConfig, register
from launch.validate import ConfigError, validate

register()

# Not a folder anyone can create, root included (sysfs refuses).
UNWRITABLE = "/sys/dscale-test-unwritable/ckpt"

JOB = [
    "model=mlp",
    "data.seq_len=32",
    "trainer.max_steps=40",
    "trainer.log_every=50",
    "checkpoint.every=1000",  # only the preemption and final saves
    "metrics.enabled=false",
    "launcher.max_restarts=0",
]


def _run(cwd: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """``python -m launch OVERRIDES`` from ``cwd``, with no run folder given: the default."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "launch", *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_rerunning_the_same_command_after_a_preemption_resumes_and_the_message_says_so(
    tmp_path: Path,
) -> None:
    command = [*JOB, "fault.preempt_step=5"]
    first = _run(tmp_path, *command)
    assert first.returncode == PREEMPTED_EXIT_CODE, output(first)
    run_dir = tmp_path / "outputs" / "dscale"
    saved = CheckpointManager(run_dir / "checkpoints").latest()
    assert saved is not None, output(first)
    step = int(saved.name.split("-")[1])

    again = _run(tmp_path, *command)  # exactly what the user typed before
    assert again.returncode == 0, output(again)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == step
    assert summary["steps"] == 40

    # Other training settings in that folder are refused before any worker starts, rather
    # than silently continuing the earlier run with them.
    changed = _run(tmp_path, *command, "trainer.lr=0.01")
    assert changed.returncode == 2, output(changed)
    assert "holds an earlier run of this job" in changed.stderr, output(changed)
    assert "trainer.lr: 0.003 -> 0.01" in changed.stderr, output(changed)
    assert "hydra.job.name=NEW_NAME" in changed.stderr

    # The exit message named that command, and where it resumes from.
    rerun = f"cd {shlex.quote(str(tmp_path))} && " + shlex.join(
        [sys.executable, "-m", "launch", *command]
    )
    assert f"to resume from step {step} ({saved}), run the same command again:" in first.stderr
    assert f"\n  {rerun}\n" in first.stderr, first.stderr
    assert "to start fresh instead, add hydra.job.name=<a new name>" in first.stderr

    # Starting fresh is explicit: a new name is a new folder; resume=none there is refused.
    fresh = _run(tmp_path, *JOB, "trainer.max_steps=3", "hydra.job.name=fresh")
    assert fresh.returncode == 0, output(fresh)
    assert (
        json.loads((tmp_path / "outputs" / "fresh" / "summary.json").read_text())["resumed_from"]
        is None
    )
    refused = _run(tmp_path, *JOB, "checkpoint.resume=none")
    assert refused.returncode == 2, output(refused)
    assert "already holds step-40 from an earlier run" in refused.stderr
    assert "hydra.job.name=NEW_NAME" in refused.stderr


def _job(*overrides: str) -> JobConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("job", overrides=list(overrides))
    job = OmegaConf.to_object(cfg)
    assert isinstance(job, JobConfig)
    return job


def test_an_unwritable_checkpoint_folder_fails_before_any_worker_naming_folder_and_fix(
    tmp_path: Path,
) -> None:
    """Before, it was found at the first save, after all the training before it."""
    with pytest.raises(ConfigError) as info:
        validate(_job("metrics.enabled=false", f"checkpoint.dir={UNWRITABLE}"))
    message = str(info.value)
    assert message.startswith(f"checkpoint.dir={UNWRITABLE}: checkpoint folder {UNWRITABLE}")
    assert "is not writable" in message and "choose it with checkpoint.dir=PATH" in message
    # The same from the command line: exit status 2, no worker started, nothing trained.
    proc = _run(tmp_path, "metrics.enabled=false", f"checkpoint.dir={UNWRITABLE}")
    assert proc.returncode == 2, output(proc)
    assert f"bad config: checkpoint.dir={UNWRITABLE}" in proc.stderr
    assert not (tmp_path / "outputs" / "dscale" / "logs").exists()


def test_resume_none_into_a_folder_holding_checkpoints_is_refused(tmp_path: Path) -> None:
    import torch

    CheckpointManager(tmp_path, every=5).save(5, model=torch.nn.Linear(2, 1))
    for resume in ("none", "never"):
        with pytest.raises(ConfigError, match="already holds step-5 from an earlier run"):
            validate(
                _job(
                    "metrics.enabled=false",
                    f"checkpoint.dir={tmp_path}",
                    f"checkpoint.resume={resume}",
                )
            )
    validate(_job("metrics.enabled=false", f"checkpoint.dir={tmp_path}"))  # auto continues


def _plain(*overrides: str) -> dict:
    job = _job(*overrides)
    return OmegaConf.to_container(OmegaConf.structured(job), resolve=True, enum_to_str=True)


def test_resuming_on_another_world_size_names_the_global_batch_change_and_the_fix(
    tmp_path: Path,
) -> None:
    import torch

    CheckpointManager(tmp_path, every=5).save(5, model=torch.nn.Linear(2, 1))  # on 1 rank
    config = _plain("metrics.enabled=false", f"checkpoint.dir={tmp_path}", "data.batch_size=8")
    said = world_size_change(config, 4)
    # Old code: only the library's "RNG states not restored: saved by 1 ranks, loading on 4".
    assert said is not None
    assert "(saved on 1 ranks) on 4 ranks" in said, said
    assert "from 8 to 32 samples per step (data.batch_size=8)" in said, said
    assert "To keep the global batch, use data.batch_size=2 on 4 ranks, or 1 ranks" in said, said
    assert world_size_change(config, 1) is None  # the same world: nothing changes
    config = _plain("metrics.enabled=false", f"checkpoint.dir={tmp_path}", "data.batch_size=3")
    assert "To keep the global batch, use 1 ranks" in (world_size_change(config, 2) or "")


def test_a_new_args_key_on_resume_is_refused_as_a_changed_setting(tmp_path: Path) -> None:
    import torch

    CheckpointManager(tmp_path / "ckpt", every=5).save(5, model=torch.nn.Linear(2, 1))
    earlier = _plain("metrics.enabled=false", f"checkpoint.dir={tmp_path / 'ckpt'}", "+args.lr=1")
    (tmp_path / "config.resolved.yaml").write_text(OmegaConf.to_yaml(earlier))
    now = _plain(
        "metrics.enabled=false", f"checkpoint.dir={tmp_path / 'ckpt'}", "+args.lr=1", "+args.wd=0"
    )
    with pytest.raises(ConfigError, match=r"args\.wd: '\(absent\)' -> 0"):
        check_same_job(tmp_path, now)  # old code: a key only one run has was not compared
    check_same_job(tmp_path, earlier)  # the same settings continue


def _folder_state(run_dir: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every path under ``run_dir``, itself included: its mtime (ns) and, for a file, its bytes."""
    state: dict[str, tuple[int, bytes | None]] = {}
    for path in [run_dir, *sorted(run_dir.rglob("*"))]:
        info = path.lstat()
        state[str(path.relative_to(run_dir))] = (
            info.st_mtime_ns,
            path.read_bytes() if path.is_file() else None,
        )
    return state


@pytest.mark.slow
def test_a_rerun_of_a_complete_run_writes_nothing_and_says_the_run_is_complete(
    tmp_path: Path,
) -> None:
    """A run already at ``trainer.max_steps`` leaves its folder byte for byte and mtime for mtime.

    Old code exited 0 but Hydra had already rewritten ``.hydra/config.yaml``, ``hydra.yaml`` and
    ``overrides.yaml`` (the record then named a command that trained nothing), and the check of
    the checkpoint folder created and removed a file in it.
    """
    from launch_helpers import launch

    run_dir = tmp_path / "run"
    job = [*JOB, "trainer.max_steps=3"]
    first = launch(run_dir, *job, timeout_s=300)
    assert first.returncode == 0, output(first)
    assert (run_dir / ".hydra" / "overrides.yaml").is_file()  # the run that trained is recorded
    recorded = (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "trainer.max_steps=3" in recorded, recorded
    before = _folder_state(run_dir)
    # The same command, then one asking for fewer steps (and other figures of its own).
    fewer = [*job, "trainer.max_steps=2", "trainer.log_every=7"]
    for again, said in [
        (job, "is already at trainer.max_steps=3"),
        (fewer, "is already past trainer.max_steps=2"),
    ]:
        proc = launch(run_dir, *again, timeout_s=120)
        assert proc.returncode == 0, output(proc)
        after = _folder_state(run_dir)
        assert sorted(after) == sorted(before), output(proc)
        changed = [p for p in before if before[p] != after[p]]
        assert changed == [], (changed, output(proc))
        assert "the run is complete" in proc.stdout, output(proc)
        assert re.search(rf"step 3 \(.*\) {said}: nothing to train; .*hydra.job.name=<name>",
                         proc.stdout), output(proc)  # fmt: skip
        assert "tokens_per_s" not in proc.stdout, output(proc)  # no worker started
        assert "dscale job finished" not in proc.stdout, output(proc)


@pytest.mark.slow
def test_a_rerun_of_a_complete_multirun_leaves_its_sweep_record_as_it_was(tmp_path: Path) -> None:
    """``multirun.yaml`` (the sweep's record, beside its jobs' folders) is left as it was too.

    On i41d (4d7c75b) each job's folder was left alone, but Hydra's sweeper rewrote the sweep's
    ``multirun.yaml`` before the first job, so a rerun asking for fewer steps left a record naming
    ``trainer.max_steps=2``, a command that trained nothing.
    """
    from launch_helpers import launch

    sweep = tmp_path / "sweep"
    job = [*JOB, "trainer.max_steps=3", "scaler.growth_interval=100,1000"]
    first = launch(tmp_path / "unused", "-m", f"hydra.sweep.dir={sweep}", *job, timeout_s=300)
    assert first.returncode == 0, output(first)
    before = _folder_state(sweep)
    assert "multirun.yaml" in before and "0/.hydra/overrides.yaml" in before, sorted(before)
    for again in (job, [*job, "trainer.max_steps=2"]):
        proc = launch(tmp_path / "unused", "-m", f"hydra.sweep.dir={sweep}", *again, timeout_s=120)
        assert proc.returncode == 0, output(proc)
        assert proc.stdout.count("the run is complete") == 2, output(proc)
        after = _folder_state(sweep)
        changed = [p for p in sorted(set(before) | set(after)) if before.get(p) != after.get(p)]
        assert changed == [], (changed, output(proc))


@pytest.mark.parametrize("typed", ["hydra.output_subdir=null", "++hydra.output_subdir=null"])
def test_hydra_output_subdir_null_typed_in_any_form_writes_no_record(
    typed: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user's ``hydra.output_subdir=null`` is honoured however it is typed.

    On i41d (4d7c75b) launch/hydra_record.py saw the choice only without a prefix, so
    ``++hydra.output_subdir=null`` (Hydra's force-add form) still got a ``.hydra/`` record.
    """
    from test_sweep import _launch

    status, started = _launch(tmp_path, monkeypatch, typed, multirun=False)
    assert (status, started) == (0, ["fp16"])
    assert (tmp_path / "run" / "config.resolved.yaml").is_file()  # the job did start
    assert not (tmp_path / "run" / ".hydra").exists()
