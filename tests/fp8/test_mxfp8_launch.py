"""The launcher takes ``fp8.recipe=mxfp8`` (validated before any worker) and converts with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import launch.fp8
from launch.schema import JobConfig, register
from launch.validate import ConfigError, validate
from tests.fp8 import _models

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
register()


def _job(*overrides: str) -> JobConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(
            "job",
            overrides=["checkpoint.dir=/tmp/dscale-mx", "metrics.enabled=false", *overrides],
        )
    job = OmegaConf.to_object(cfg)
    assert isinstance(job, JobConfig)
    return job


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_wgrad_with_hp"])
def test_launcher_accepts_the_mxfp8_recipes_and_converts_to_torchaos_mxfp8linear(recipe):
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.quantization.quantize_.common import KernelPreference

    validate(_job("trainer.precision=fp8", f"fp8.recipe={recipe}"))  # no ConfigError
    model = _models.net()
    conv = launch.fp8.convert(model, {"recipe": recipe}, torch.device("cpu"))
    assert conv.recipe == recipe and "head" in conv.left
    fc1 = model.blocks[0].fc1
    assert isinstance(fc1, MXFP8Linear)
    assert fc1.kernel_preference == KernelPreference.EMULATED  # emulate=auto on a CPU
    assert launch.fp8.numerics_every({"recipe": recipe}) == 0  # off unless asked
    validate(_job("trainer.precision=fp8", f"fp8.recipe={recipe}", "fp8.numerics_every=5"))


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["fp8.recipe=mxfp8", "fp8.numerics_every=-1"], "fp8.numerics_every"),
        (["fp8.recipe=mxfp8", "fp8.float8_all_gather=true", "parallel=fsdp"], "MXFP8"),
        (["fp8.recipe=mxfp8", "fp8.fallback=true"], "fp8.fallback"),
    ],
)
def test_launcher_refuses_what_the_mxfp8_recipe_cannot_do_naming_the_key(overrides, named):
    with pytest.raises(ConfigError, match=named):
        validate(_job("trainer.precision=fp8", *overrides))


def test_a_mistyped_recipe_is_refused_listing_the_mxfp8_recipes():
    from hydra.errors import ConfigCompositionException

    with pytest.raises((ConfigError, ConfigCompositionException)) as err:
        validate(_job("trainer.precision=fp8", "fp8.recipe=mxfp9"))
    assert "mxfp8" in str(err.value) + str(err.value.__cause__)
