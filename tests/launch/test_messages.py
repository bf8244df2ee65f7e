"""The launcher's messages name values as the user typed them (``parallel=ddp``)."""

from __future__ import annotations

import inspect

import pytest
from hydra import compose, initialize_config_dir
from launch_helpers import CONFIGS
from omegaconf import OmegaConf

from launch import schema
from launch.schema import JobConfig, register
from launch.validate import ConfigError, validate

register()

_CHOICES = [
    cls
    for _, cls in inspect.getmembers(schema, inspect.isclass)
    if issubclass(cls, schema.Enum)
    and cls not in (schema.Enum, getattr(schema, "Choice", None))
    and cls.__module__ == schema.__name__
]


def _job(*overrides: str) -> JobConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("job", overrides=["checkpoint.dir=/tmp/dscale-bad", *overrides])
    job = OmegaConf.to_object(cfg)
    assert isinstance(job, JobConfig)
    return job


@pytest.mark.parametrize("choice", _CHOICES, ids=lambda c: c.__name__)
def test_every_choice_prints_as_the_value_typed(choice: type) -> None:
    """f"{job.parallel.strategy}" printed Strategy.ddp; the user typed ddp."""
    assert len(choice) > 1
    for member in choice:
        assert f"{member}" == str(member) == member.value, member
        assert f"{member:>8}" == f"{member.value:>8}"


def test_the_float8_all_gather_refusal_names_parallel_as_typed() -> None:
    """fp8.float8_all_gather under parallel=ddp: the message says parallel=ddp."""
    job = _job(
        "metrics.enabled=false",
        "parallel=ddp",
        "trainer.precision=fp8",
        "fp8.float8_all_gather=true",
    )
    with pytest.raises(ConfigError) as info:
        validate(job)
    assert "parallel=ddp" in str(info.value)
    assert "Strategy" not in str(info.value)
