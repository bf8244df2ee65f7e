"""Every YAML in configs/ composes against the schema, and the scaler keys are GradScaler's."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from launch_helpers import CONFIGS, EXAMPLE
from omegaconf import OmegaConf

import dscale
from launch.context import DTYPES
from launch.schema import JobConfig, Precision, ScalerConfig, Strategy, register
from launch.validate import ConfigError, check_known_keys, scaler_parameters, validate

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
        "parallel": ["2d", "ddp", "fsdp", "hsdp", "pp", "single", "tp"],
    }


@pytest.mark.parametrize("option", OPTIONS)
def test_every_yaml_composes_and_validates(option: str, tmp_path: Path) -> None:
    extra = [f"data.path={__file__}"] if option == "data=text" else []
    if option == "parallel=single":
        extra.append("launcher.nproc_per_node=1")
    if option in ("parallel=2d", "parallel=hsdp"):  # two mesh dims of 2
        extra.append("launcher.nproc_per_node=4")
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
        default = params[f.name].default
        default = list(default) if isinstance(default, tuple) else default  # YAML has lists
        assert getattr(ScalerConfig(), f.name) == default, f.name


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


def test_choice_fields_are_listed_once_and_their_consumers_follow() -> None:
    # The schema's Enums are the only lists: the parallel group has one YAML per strategy, and
    # the context knows a dtype for every precision.
    assert GROUPS["parallel"] == sorted(s.value for s in Strategy)
    assert sorted(DTYPES) == sorted(p.value for p in Precision)


EXAMPLE_CONF = EXAMPLE / "conf"


@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_example_project_config_extends_the_launchers_job(optim: str, monkeypatch) -> None:
    # What `dscale-launch --config-dir conf --config-name train` composes: the project's primary
    # config with the launcher's `job` underneath it, and the project's own group args/optim.
    # Run from the project's folder, as the launcher is: validate() imports the entrypoint.
    monkeypatch.syspath_prepend(str(EXAMPLE))
    with initialize_config_dir(config_dir=str(EXAMPLE_CONF), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                f"hydra.searchpath=[file://{CONFIGS}]",
                "checkpoint.dir=/tmp/dscale-compose",
                "metrics.enabled=false",
                f"args/optim={optim}",
                "args.layers=3",  # an existing key: no +
                "+args.extra.depth=4",  # a new one: +, nested
            ],
        )
    check_known_keys(cfg)  # args is the user's: anything goes there
    job = OmegaConf.to_object(cfg)
    assert isinstance(job, JobConfig)
    validate(job)
    assert job.entrypoint == "tiny_regression.train:main"
    assert job.args["optim"]["name"] == optim
    assert (job.args["layers"], job.args["extra"]) == (3, {"depth": 4})
    assert job.scaler.init_scale == 256.0  # the project's own value for a launcher key
    assert job.trainer.max_steps == 60


def test_a_group_on_hydra_searchpath_composes_into_args_while_launcher_keys_stay_checked() -> None:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        overrides = [
            f"hydra.searchpath=[file://{EXAMPLE_CONF}]",
            "checkpoint.dir=/tmp/dscale-compose",
            "+args/optim=adam",
            "+args.lr=0.1",
        ]
        cfg = compose("job", overrides=overrides)
        check_known_keys(cfg)
        assert OmegaConf.to_container(cfg.args) == {
            "optim": {"name": "adam", "lr": 0.01, "weight_decay": 0.0},
            "lr": 0.1,
        }
        with pytest.raises(ConfigError, match=r"trainer\.lrr is not a config key"):
            check_known_keys(compose("job", overrides=[*overrides, "+trainer.lrr=0.1"]))
