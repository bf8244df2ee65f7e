"""Every key with a fixed set of values is refused before any worker starts, nearest value named.

Old code checked some of them only on the workers (``fp8.recipe=tensorwis`` started both ranks,
which failed with status 1), read ``fp8.emulate=ture`` as false without a word, and gave Hydra's
list of choices without the nearest one for the Enum keys.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from launch_helpers import CONFIGS, launch, output
from omegaconf import OmegaConf

import launch.app as launch_app
from launch.choices import choice_keys
from launch.schema import DataConfig, JobConfig, ModelConfig, register

register()

# Keys whose value is free text (a path, a name, an address, a spec): no fixed set to check.
FREE = {
    "entrypoint",
    "script",
    "script_args",
    "launcher.nnodes",  # N or MIN:MAX, checked by validate
    "launcher.rdzv_endpoint",
    "launcher.rdzv_id",
    "launcher.rdzv_conf",
    "launcher.master_addr",
    "launcher.local_addr",
    "fp8.keep_high_precision",  # layer names of the user's model
    "metrics.addr",
    "metrics.targets_dir",
    "checkpoint.dir",
    "checkpoint.resume",  # auto, none or a step-N path
    "data.path",
}


def _str_fields(schema: type, prefix: str = "") -> set[str]:
    hints = typing.get_type_hints(schema)
    found: set[str] = set()
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            found |= _str_fields(kind, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        elif kind in (str, str | None, list[str]):
            found.add(prefix + f.name)
    return found


def _every_str_key() -> set[str]:
    keys = _str_fields(JobConfig)
    for group, base in (("model", ModelConfig), ("data", DataConfig)):
        for cls in base.__subclasses__():
            keys |= _str_fields(cls, f"{group}.")
    return keys


def test_every_str_key_of_the_schema_is_a_checked_choice_or_declared_free_text() -> None:
    """A new str key must be declared a choice (``schema.choice``) or added to FREE here."""
    undecided = _every_str_key() - set(choice_keys()) - FREE
    assert undecided == set(), "declare these with schema.choice(...) or add them to FREE"
    assert _every_str_key() >= FREE  # no stale entry


def _typo(value: str) -> str:
    """A value one letter short of ``value`` (what a hurried hand types)."""
    return value[:-1]


def _main(run_dir: Path, override: str, monkeypatch: pytest.MonkeyPatch) -> int:
    """``python -m launch hydra.run.dir=RUN_DIR OVERRIDE`` in this process; its exit status.

    Starting workers would fail the test: the launcher's one call that starts them raises.
    """

    def no_workers(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"workers would start with {override}")

    monkeypatch.setattr(launch_app, "_run", no_workers)
    monkeypatch.setattr(
        sys, "argv", ["launch", f"hydra.run.dir={run_dir}", "metrics.enabled=false", override]
    )
    GlobalHydra.instance().clear()
    try:
        launch_app.main()
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        GlobalHydra.instance().clear()
    return 0


CHOICES = choice_keys()


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_a_mistyped_choice_is_refused_before_any_worker_naming_key_value_and_nearest(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    values = CHOICES[key]
    meant = "gpt_small" if key == "model.name" else values[-1]
    typed = _typo(meant)
    is_list = key in ("scaler.spike_signals", "checkpoint.save_on_signals")
    override = f"{key}=[{typed}]" if is_list else f"{key}={typed}"
    run_dir = tmp_path / "run"
    status = _main(run_dir, override, monkeypatch)
    err = capsys.readouterr().err
    assert status == 2, err
    said = err.strip().splitlines()[0]
    if is_list:
        assert said.startswith(f"dscale-launch: bad config: {key} has {typed}, which is not "), err
        assert said.endswith(f"did you mean {meant}?"), err
    else:
        assert said.startswith(f"dscale-launch: bad config: {key}={typed} is not one of "), err
        assert said.endswith(f"did you mean {key}={meant}?"), err
    assert not (run_dir / "logs").exists() and not (run_dir / "torchelastic").exists()


def _job(*overrides: str) -> JobConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("job", overrides=["checkpoint.dir=/tmp/dscale-choices", *overrides])
    job = OmegaConf.to_object(cfg)
    assert isinstance(job, JobConfig)
    return job


def test_valid_spellings_pass_and_a_group_name_must_match_its_group() -> None:
    from launch.choices import bad_choice

    assert bad_choice(_job()) is None  # the default job
    for fine in (
        "fp8.emulate=true",  # Hydra reads it as a boolean: the str field holds "True"
        "fp8.emulate=False",
        "checkpoint.save_on_signals=[term,SIGUSR1]",  # any case, SIG optional (the library's)
        "launcher.nproc_per_node=4",
        "scaler.spike_signals=[loss,grad_norm]",
    ):
        assert bad_choice(_job(fine)) is None, fine
    said = bad_choice(_job("model=mlp", "model.name=gpt_small"))
    assert said is not None and said.startswith(
        "model.name=gpt_small does not match the model picked (model=mlp)"
    ), said


def test_the_declared_values_are_the_librarys() -> None:
    """Where dscale's signature has no Literal, the declared values are what it accepts."""
    import dscale
    from dscale.checkpoint import PreemptionGuard

    for signal in CHOICES["scaler.spike_signals"]:
        dscale.GradScaler("cpu", spike_signals=[signal])
    with pytest.raises(ValueError, match="spike_signals"):
        dscale.GradScaler("cpu", spike_signals=["los"])
    PreemptionGuard(CHOICES["checkpoint.save_on_signals"])


@pytest.mark.slow
def test_a_mistyped_fp8_recipe_exits_2_before_any_worker(tmp_path: Path) -> None:
    """The issue's case, from the command line: old code started both ranks (status 1)."""
    proc = launch(
        tmp_path,
        "trainer.precision=fp8",
        "fp8.recipe=tensorwis",
        "metrics.enabled=false",
        timeout_s=120,
    )
    assert proc.returncode == 2, output(proc)
    assert proc.stderr.startswith(
        "dscale-launch: bad config: fp8.recipe=tensorwis is not one of tensorwise, rowwise, "
        "mxfp8, mxfp8_wgrad_with_hp, nvfp4; "
        "did you mean fp8.recipe=tensorwise?"
    ), output(proc)
    assert not (tmp_path / "logs").exists() and not (tmp_path / "torchelastic").exists()
