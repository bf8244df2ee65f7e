"""A key typed for a setting the job does not have is refused before any worker starts.

Old code read ``fp8.*`` only with ``trainer.precision=fp8`` and said nothing otherwise: an FSDP
float8 all-gather run typed without it trained plain bf16 and exited 0. Likewise every other key
that only applies under another setting (launch/applies.py's rules, each covered here).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from launch_helpers import CONFIGS, launch, output
from omegaconf import OmegaConf
from test_choices import _main

from launch.applies import RULES, Needs, unused_keys
from launch.schema import JobConfig, register
from launch.validate import ConfigError, validate

register()

# For each rule (by its first key): overrides under which its setting does not hold, and ones
# under which it does.
SETTINGS: dict[str, tuple[list[str], list[str]]] = {
    "fp8.": (["trainer.precision=bf16"], ["trainer.precision=fp8"]),
    "fp8.predict": (
        ["trainer.precision=fp8"],
        ["trainer.precision=fp8", "parallel=fsdp", "fp8.float8_all_gather=true"],
    ),
    "fp8.fallback_threshold": (
        ["trainer.precision=fp8"],
        ["trainer.precision=fp8", "fp8.fallback=true"],
    ),
    "scaler.": (["scaler.enabled=false"], []),
    "scaler.init_scale": (["trainer.precision=bf16"], ["trainer.precision=fp16"]),
    "scaler.predictive_window": ([], ["scaler.policy=predictive"]),
    "scaler.spike_sigma": ([], ["scaler.spike_signals=[loss]"]),
    "scaler.on_stuck_at_min": ([], ["scaler.min_scale=1.0"]),
    "fault.inf_rank": ([], ["fault.inf_steps=[1]"]),
    "fault.spike_rank": ([], ["fault.spike_steps=[1]"]),
    "fault.kill_rank": ([], ["fault.kill_step=1"]),
    "metrics.": (["metrics.enabled=false"], []),
    "metrics.:scaler": (["scaler.enabled=false"], []),
    "checkpoint.": (["checkpoint.enabled=false"], []),
    "script_args": ([], [f"script={__file__}"]),
    "trainer.compile_step": ([f"script={__file__}"], []),
    "trainer.compile_backend": ([], ["trainer.compile_step=true"]),
    "launcher.master_addr": (
        ["launcher.nnodes=2", "launcher.rdzv_endpoint=h:29500"],
        ["launcher.nnodes=2"],
    ),
    "launcher.node_rank": ([], ["launcher.nnodes=2", "launcher.rdzv_endpoint=h:29500"]),
}


def _name(rule: Needs) -> str:
    first = rule.keys[0]
    return f"{first}:scaler" if first == "metrics." and "scaler" in rule.setting else first


def _schema_keys(schema: type = JobConfig, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(schema)
    keys = []
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _schema_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _job(*overrides: str) -> JobConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("job", overrides=["checkpoint.dir=/tmp/dscale-applies", *overrides])
    job = OmegaConf.to_object(cfg)
    assert isinstance(job, JobConfig)
    return job


def test_every_rule_is_covered_here() -> None:
    assert sorted(map(_name, RULES)) == sorted(SETTINGS)


@pytest.mark.parametrize("rule", RULES, ids=_name)
def test_each_key_of_a_rule_is_refused_without_its_setting_and_read_with_it(rule: Needs) -> None:
    breaks, holds = SETTINGS[_name(rule)]
    keys = [k for k in _schema_keys() if rule.covers(k)]
    assert keys, f"{rule.keys} names no key of the schema"
    without, with_it = _job(*breaks), _job(*holds)
    assert not rule.holds(without) and rule.holds(with_it)
    for key in keys:
        typed = f"{key}=7"  # what the value is does not matter: that it was typed does
        said = unused_keys(without, [typed]) or ""
        assert f"{typed} is read only with " in said and rule.setting in said, (key, said)
        assert f"drop {key}" in said, said
        assert rule.setting not in (unused_keys(with_it, [typed]) or ""), key
    # Keys that were not typed are never refused: configs/*.yaml and the user's own YAML set
    # values for the runs that use them.
    assert unused_keys(without, []) is None


def test_the_issues_fsdp_float8_run_without_fp8_is_refused_naming_the_missing_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the launcher's main: old code started the workers (a bf16 run, status 0)."""
    run_dir = tmp_path / "run"
    status = _main(run_dir, "fp8.float8_all_gather=true", monkeypatch)
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith(
        "dscale-launch: bad config: fp8.float8_all_gather=true is read only with "
        "trainer.precision=fp8, so this job would ignore it: add that, or drop "
        "fp8.float8_all_gather"
    ), err
    assert not (run_dir / "logs").exists() and not (run_dir / "torchelastic").exists()


@pytest.mark.parametrize(
    ("typed", "breaks", "key"),
    [
        ("fp8={float8_all_gather:true}", ["trainer.precision=bf16"], "fp8.float8_all_gather"),
        ("scaler={init_scale:4.0}", ["trainer.precision=bf16"], "scaler.init_scale"),
        ("metrics={linger_s:1.0}", ["metrics.enabled=false"], "metrics.linger_s"),
        ("checkpoint={every:5}", ["checkpoint.enabled=false"], "checkpoint.every"),
    ],
)
def test_a_node_given_as_a_dict_is_refused_like_its_keys(
    typed: str, breaks: list[str], key: str
) -> None:
    """``fp8={float8_all_gather:true}`` types fp8.float8_all_gather as the dotted form does.

    Old code (i41d) read the typed key as ``fp8``, which no rule covers: the issue's FSDP float8
    all-gather run, typed in Hydra's dict form without trainer.precision=fp8, trained plain
    bf16 with status 0.
    """
    said = unused_keys(_job(*breaks, typed), [typed]) or ""
    assert said.startswith(f"{typed} is read only with "), said
    assert said.endswith(f"drop {key}"), said


def test_the_issues_run_in_dict_form_exits_2_before_any_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the launcher's main (a worker start fails the test); old code started them."""
    run_dir = tmp_path / "run"
    status = _main(run_dir, "fp8={float8_all_gather:true}", monkeypatch)
    err = capsys.readouterr().err
    assert status == 2, err
    assert "read only with trainer.precision=fp8" in err and "drop fp8.float8_all_gather" in err


def test_master_addr_and_port_typed_beside_an_endpoint_are_refused_node_rank_is_read() -> None:
    """launch/elastic.py's static rendezvous uses ``launcher.rdzv_endpoint`` when it is given, and
    ``master_addr:master_port`` only without one (the oracle: the LaunchConfig it builds).

    On i41d (4d7c75b) both keys were accepted beside an endpoint, and silently ignored.
    """
    from launch.elastic import launch_config

    job = _job("launcher.nnodes=2", "launcher.rdzv_endpoint=h:29500")
    for typed in ("launcher.master_addr=10.0.0.9", "launcher.master_port=29999"):
        moved = _job("launcher.nnodes=2", "launcher.rdzv_endpoint=h:29500", typed)
        assert launch_config(moved.launcher, 1, Path("/tmp")).rdzv_endpoint == "h:29500"
        said = unused_keys(job, [typed]) or ""
        assert said.startswith(f"{typed} is read only with launcher.rdzv_backend=static"), said
        assert "without launcher.rdzv_endpoint" in said, said
        assert unused_keys(_job("launcher.nnodes=2"), [typed]) is None  # read there
    assert unused_keys(job, ["launcher.node_rank=1"]) is None  # the static store's rank


def test_validate_without_typed_keys_refuses_nothing_for_them() -> None:
    """Python callers of validate() (tests, tools) pass no command line: nothing is assumed."""
    validate(_job("metrics.enabled=false", "trainer.precision=bf16"))
    with pytest.raises(ConfigError, match=r"fp8\.recipe=rowwise is read only with"):
        validate(_job("metrics.enabled=false", "fp8.recipe=rowwise"), typed=["fp8.recipe=rowwise"])


@pytest.mark.slow
def test_fp8_keys_on_a_bf16_fsdp_job_exit_2_before_any_worker(tmp_path: Path) -> None:
    """The issue's run from the command line: parallel=fsdp, float8 all-gather, no fp8."""
    proc = launch(
        tmp_path,
        "parallel=fsdp",
        "trainer.precision=bf16",
        "fp8.float8_all_gather=true",
        "metrics.enabled=false",
        timeout_s=120,
    )
    assert proc.returncode == 2, output(proc)
    assert "fp8.float8_all_gather=true is read only with trainer.precision=fp8" in proc.stderr
    assert not (tmp_path / "logs").exists() and not (tmp_path / "torchelastic").exists()
