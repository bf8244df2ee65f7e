"""Every YAML in configs/ composes against the schema, and the scaler keys are GradScaler's."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from launch_helpers import CONFIGS
from omegaconf import OmegaConf

import dscale
from launch.schema import JobConfig, ScalerConfig, register
from launch.validate import scaler_parameters, validate

register()

GROUPS = {
    group.name: sorted(p.stem for p in group.glob("*.yaml"))
    for group in CONFIGS.iterdir()
    if group.is_dir()
}
OPTIONS = [f"{g}={o}" for g, options in sorted(GROUPS.items()) for o in options]


def _compose(*overrides: str) -> JobConfig:
    # checkpoint.dir defaults to ${hydra:runtime.output_dir}/..., which resolves only in a run.
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("job", overrides=["checkpoint.dir=/tmp/dscale-compose", *overrides])
    job = OmegaConf.to_object(cfg)
    assert isinstance(job, JobConfig)
    return job


def test_every_group_has_the_options_the_docs_promise() -> None:
    assert GROUPS == {
        "data": ["synthetic", "text"],
        "launcher": ["local", "slurm"],
        "model": ["gpt_small", "mlp"],
        "parallel": ["ddp", "fsdp", "single"],
    }


@pytest.mark.parametrize("option", OPTIONS)
def test_every_yaml_composes_and_validates(option: str, tmp_path: Path) -> None:
    extra = [f"data.path={__file__}"] if option == "data=text" else []
    if option == "parallel=single":
        extra.append("launcher.nproc_per_node=1")
    job = _compose(option, "metrics.enabled=false", *extra)
    nproc = validate(job)
    assert nproc >= 1
    group, name = option.split("=")
    node = getattr(job, group)
    if group in ("model", "data"):
        assert node.name == name
    if group == "parallel":
        assert node.strategy == name


def test_defaults_are_the_documented_cpu_job() -> None:
    job = _compose()
    assert (job.parallel.strategy, job.model.name, job.data.name) == (
        "ddp",
        "gpt_small",
        "synthetic",
    )
    assert job.trainer.precision == "fp16"
    assert job.metrics.enabled is True
    assert job.checkpoint.enabled and job.checkpoint.resume == "auto"
    # torchrun's defaults, not LaunchConfig's (etcd, 3 restarts).
    assert (job.launcher.rdzv_backend, job.launcher.max_restarts) == ("static", 0)


def test_scaler_config_has_exactly_gradscaler_keyword_arguments() -> None:
    fields = [f.name for f in dataclasses.fields(ScalerConfig)]
    assert sorted(fields) == sorted(scaler_parameters())


def test_scaler_config_defaults_are_gradscaler_defaults() -> None:
    params = inspect.signature(dscale.GradScaler).parameters
    for f in dataclasses.fields(ScalerConfig):
        assert getattr(ScalerConfig(), f.name) == params[f.name].default, f.name


def test_pet_environment_variables_reach_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NNODES", "2:4")
    monkeypatch.setenv("PET_MAX_RESTARTS", "3")
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "head:29400")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    job = _compose("metrics.enabled=false")
    lc = job.launcher
    assert (lc.nnodes, lc.max_restarts, lc.rdzv_backend, lc.rdzv_endpoint) == (
        "2:4",
        3,
        "c10d",
        "head:29400",
    )
    assert validate(job) == 3


def test_command_line_beats_pet_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_MAX_RESTARTS", "3")
    job = _compose("metrics.enabled=false", "launcher.max_restarts=1")
    assert job.launcher.max_restarts == 1
