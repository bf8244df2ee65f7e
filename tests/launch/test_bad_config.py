"""Bad config fails before any worker starts, and the message names the key and the fix."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from launch_helpers import CONFIGS, launch, output
from omegaconf import OmegaConf

from launch.schema import JobConfig, register
from launch.typos import misspelt_key
from launch.validate import ConfigError, check_known_keys, validate

register()


def _job(*overrides: str) -> JobConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("job", overrides=["checkpoint.dir=/tmp/dscale-bad", *overrides])
    job = OmegaConf.to_object(cfg)
    assert isinstance(job, JobConfig)
    return job


def _no_worker_started(run_dir: Path) -> bool:
    return not (run_dir / "logs").exists() and not (run_dir / "torchelastic").exists()


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("scaler.backoff_factor=2.0", "scaler.backoff_factor"),
        ("scaler.growth_interval=0", "scaler.growth_interval"),
        ("scaler.hysteresis_refill=sometimes", "scaler.hysteresis_refill"),
        ("scaler.policy=adaptive", "scaler.policy"),
        ("trainer.max_steps=0", "trainer.max_steps"),
        ("launcher.nnodes=3:2", "launcher.nnodes"),
        ("launcher.nproc_per_node=lots", "launcher.nproc_per_node"),
        ("launcher.max_restarts=-1", "launcher.max_restarts"),
        ("launcher.nnodes=2 launcher.rdzv_backend=c10d", "launcher.rdzv_endpoint=HOST:PORT"),
        ("model.n_heads=5", "model.n_heads"),
        ("fault.inf_steps=[5] fault.inf_rank=7", "fault.inf_rank"),
        ("fault.inf_steps=[5] scaler.enabled=false", "fault.inf_steps needs the step guard"),
        ("fault.spike_steps=[500]", "fault.spike_steps"),
        ("fault.inf_steps=[0]", "outside 1..trainer.max_steps=300"),  # steps count from 1
        ("fault.kill_step=0", "fault.kill_step has"),
        ("fault.preempt_step=301", "fault.preempt_step has"),
        ("fault.spike_steps=[5] fault.spike_rank=7", "fault.spike_rank"),
        ("scaler.spike_signals=[lr]", "spike_signals"),
        ("checkpoint.resume=/no/such/step-5", "checkpoint.resume"),
        (f"checkpoint.resume={__file__}", "checkpoint.resume"),  # a file, not a step-N folder
        ("checkpoint.every=-1", "checkpoint.every"),
        ("checkpoint.keep=0", "checkpoint.keep"),
        ("entrypoint=my_pkg.train", "entrypoint='my_pkg.train' is not MODULE:FUNCTION"),
        ("script=/no/such/train.py", "script='/no/such/train.py' does not exist"),
        (f"script={__file__} entrypoint=a:b", "both given"),
        ("data=text data.path=/no/such/file.txt", "data.path"),
        ("parallel=single launcher.nproc_per_node=2", "parallel=single"),
        ("trainer.precision=fp8 fp8.float8_all_gather=true", "fp8.float8_all_gather"),
        ("trainer.precision=fp8 fp8.fallback=true fp8.numerics_every=0", "fp8.fallback"),
        ("trainer.precision=fp8 fp8.fallback=true fp8.fallback_threshold=2", "fallback_threshold"),
        ("trainer.precision=fp8 fp8.numerics_every=-1", "fp8.numerics_every"),
        ("trainer.precision=fp8 fp8.predict=psychic", "fp8.predict"),
        (
            "trainer.precision=fp8 ++fp8.schedule.initial={layers.0.mlp.9:bf16}",
            "fp8.schedule: PrecisionSchedule: initial names layers that are not linears",
        ),
        (
            "trainer.precision=fp8 ++fp8.schedule.initial={layers.0.mlp.0:bf16} "
            "++fp8.schedule.switches={5:{head:bf16}}",
            "which initial does not; every switched layer needs its format at step 0",
        ),
        (
            "trainer.precision=fp8 parallel=fsdp ++fp8.schedule.initial={layers.0.mlp.0:bf16}",
            "fp8.schedule swaps layers' modules",
        ),
        (
            "trainer.precision=fp8 scaler.enabled=false "
            "++fp8.schedule.initial={layers.0.mlp.0:bf16}",
            "fp8.schedule counts the steps of the job's scaler",
        ),
        # The mesh's degrees against the world size (2 ranks unless said) and the demo model.
        ("parallel=tp parallel.tp=4", "parallel.tp=4 but the job has 2 ranks"),
        ("parallel=pp parallel.pp=3", "parallel.pp=3 but the job has 2 ranks"),
        ("parallel=2d", "parallel=2d parallel.tp=2 must split the 2 ranks into two mesh dims"),
        ("parallel=2d launcher.nproc_per_node=6 parallel.tp=4", "use parallel.tp=2 or 3"),
        ("parallel=hsdp launcher.nproc_per_node=4 parallel.replicate=4", "parallel.replicate=2"),
        ("parallel=tp parallel.tp=0", "parallel.tp=0 must be >= 1"),
        ("parallel=tp model.n_heads=3 model.d_model=63", "model.n_heads=3 is not divisible by 2"),
        ("parallel=tp model=mlp", "use model=gpt_small"),
        ("parallel=pp model.n_layers=3", "model.n_layers=3 is not divisible by 2"),
        ("parallel=pp parallel.microbatches=3", "must divide data.batch_size=8"),
        ("parallel=pp parallel.microbatches=1", "parallel.schedule=1f1b needs parallel.micro"),
        ("parallel=pp fault.spike_steps=[3]", "drop fault.spike_steps"),
        ("parallel=tp trainer.precision=fp8", "trainer.precision=fp8 under parallel=tp"),
        (
            "parallel=tp launcher.nnodes=1:2 launcher.rdzv_backend=c10d "
            "launcher.rdzv_endpoint=127.0.0.1:29400",
            "give a fixed number of nodes",
        ),
    ],
)
def test_impossible_value_names_its_key(override: str, named: str) -> None:
    job = _job("metrics.enabled=false", *override.split())
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        validate(job)


@pytest.mark.parametrize(
    ("override", "choices"),
    [
        ("trainer.precision=fp4", "[fp16, bf16, fp32, fp8]"),
        ("parallel.strategy=dp", "[single, ddp, fsdp, hsdp, tp, pp, 2d]"),
        ("trainer.device=tpu", "[auto, cpu, cuda]"),
        ("launcher.start_method=thread", "[spawn, fork, forkserver]"),
    ],
)
def test_a_choice_outside_the_schema_fails_at_composition_listing_the_choices(
    override: str, choices: str
) -> None:
    with pytest.raises(Exception, match="Error merging override") as info:
        _job(override)
    cause = str(info.value.__cause__)
    assert f"expected one of {choices}" in cause
    assert f"full_key: {override.split('=')[0]}" in cause


def test_checkpoint_values_the_library_takes_are_accepted(tmp_path: Path) -> None:
    # The library's rules, not stricter copies: every=0 saves only at the end, "never" and ""
    # mean a fresh start, and a folder is made absolute for workers that start elsewhere.
    import torch

    from dscale.checkpoint import CheckpointManager

    CheckpointManager(tmp_path, every=5).save(5, model=torch.nn.Linear(2, 1))
    for override in ("checkpoint.every=0", "checkpoint.resume=never", "checkpoint.resume=''"):
        validate(_job("metrics.enabled=false", override))
    job = _job("metrics.enabled=false", f"checkpoint.resume={tmp_path}/./step-5")
    validate(job)
    assert job.checkpoint.resume == str(tmp_path / "step-5")
    # The library's folder check runs before any worker starts: an empty folder is refused.
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is empty"):
        validate(_job("metrics.enabled=false", f"checkpoint.resume={tmp_path}/empty"))


def test_scaler_message_is_the_librarys_own(tmp_path: Path) -> None:
    import dscale

    with pytest.raises(ValueError, match="backoff_factor") as lib:
        dscale.GradScaler("cpu", backoff_factor=2.0)
    with pytest.raises(ConfigError) as ours:
        validate(_job("metrics.enabled=false", "scaler.backoff_factor=2.0"))
    assert str(lib.value) in str(ours.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "+trainer.max_stepz=5",
            "trainer.max_stepz is not a config key; did you mean trainer.max_steps?",
        ),
        ("+model.n_head=2", "model.n_head is not a config key; did you mean model.n_heads?"),
        ("+turbo=1", "turbo is not a config key"),
    ],
)
def test_key_appended_with_plus_is_refused_not_dropped(override: str, message: str) -> None:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("job", overrides=["checkpoint.dir=/tmp/dscale-bad", override])
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_known_keys(cfg)


def test_unknown_key_fails_at_composition_before_any_worker(tmp_path: Path) -> None:
    proc = launch(tmp_path, "trainer.max_stepz=5", timeout_s=120)
    assert proc.returncode == 2, output(proc)
    # The likely fix first, and not Hydra's "+trainer.max_stepz=5", which leads only to a refusal.
    assert proc.stderr.startswith(
        "dscale-launch: bad config: trainer.max_stepz is not a config key; "
        "did you mean trainer.max_steps?"
    ), output(proc)
    assert "+trainer.max_stepz" not in proc.stderr, output(proc)
    assert _no_worker_started(tmp_path)


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (
            ["trainer.max_stepz=10"],
            "trainer.max_stepz is not a config key; did you mean trainer.max_steps?",
        ),
        (["model.d_modle=32"], "did you mean model.d_model?"),
        (["model=mlp", "model.hiden=8"], "did you mean model.hidden?"),
        (["data.seq_lenn=8"], "did you mean data.seq_len?"),
        (["launcher.nproc_per_nod=1"], "did you mean launcher.nproc_per_node?"),
        (["parallel.stratgy=ddp"], "did you mean parallel.strategy?"),
        (["scaler.growth_intervall=5"], "did you mean scaler.growth_interval?"),
        (["metrics.prot=1"], "did you mean metrics.port?"),
        (["checkpoint.evry=5"], "did you mean checkpoint.every?"),
        (["fault.inf_step=[1]"], "did you mean fault.inf_steps?"),
        (["entrypiont=x:y"], "did you mean entrypoint?"),
        (["-m", "trainer.max_stepz=10,20"], "did you mean trainer.max_steps?"),
        (["hydra.job.name=x", "trainer.max_stepz=10"], "did you mean trainer.max_steps?"),
        # A group option: Hydra's message lists base_parallel (a schema node) and names no fix.
        (
            # (dpp is one letter from both ddp and pp; ddpp only from ddp)
            ["parallel=ddpp"],
            "parallel=ddpp is not one of 2d, ddp, fsdp, hsdp, pp, single, tp; did you mean "
            "parallel=ddp?",
        ),
        (
            ["model=gpt_smal"],
            "model=gpt_smal is not one of gpt_small, mlp; did you mean model=gpt_small?",
        ),
        (["launcher=slrum"], "did you mean launcher=slurm?"),
    ],
)
def test_a_mistyped_key_is_named_with_its_fix_for_every_group(argv: list[str], hint: str) -> None:
    assert hint in (misspelt_key(argv, str(CONFIGS), "job") or "")


@pytest.mark.parametrize(
    "argv",
    [
        ["trainer.max_steps=10", "model=mlp"],  # fine: Hydra composes it
        ["+args.lr=1", "args.lr=2"],  # a user's own key, added then set
        ["trainer.zzzzzz=1"],  # nothing close: Hydra's message (and its + advice) stands
        ["--config-dir", "elsewhere", "trainer.max_stepz=1"],  # other configs: Hydra's message
    ],
)
def test_no_hint_where_hydra_says_it_or_nothing_is_wrong(argv: list[str]) -> None:
    assert misspelt_key(argv, str(CONFIGS), "job") is None


def test_bad_value_exits_2_with_the_key_before_any_worker(tmp_path: Path) -> None:
    proc = launch(tmp_path, "scaler.backoff_factor=2.0", "metrics.enabled=false", timeout_s=120)
    assert proc.returncode == 2, output(proc)
    assert "bad config: scaler.backoff_factor" in proc.stderr, output(proc)
    assert _no_worker_started(tmp_path)


def test_taken_metrics_port_fails_before_any_worker(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # Rank 1 serves on base + 1: make the busy port rank 1's, so the whole range is checked.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port - 1))  # fails the test if base is taken by chance
        proc = launch(tmp_path, f"metrics.port={port - 1}", timeout_s=120)
    assert proc.returncode == 2, output(proc)
    assert f"metrics.port={port - 1}: port {port} is in use" in proc.stderr, output(proc)
    assert "metrics.port=..." in proc.stderr  # the fix
    assert _no_worker_started(tmp_path)


def test_a_pipeline_job_that_would_resume_is_validated_like_any_other(tmp_path: Path) -> None:
    """A pp rerun is no longer refused before it starts: it failed at its first step (AdamW:
    KeyError 'betas', the stages' optimizer param groups saved by position), and the
    checkpoint now keys them by parameter name (tests/launch/test_mesh_jobs.py resumes one)."""
    import torch

    from dscale.checkpoint import CheckpointManager

    CheckpointManager(str(tmp_path), every=0).save(4, model=torch.nn.Linear(2, 2))
    validate(_job("metrics.enabled=false", "parallel=pp", f"checkpoint.dir={tmp_path}"))


def test_a_precision_schedule_with_int_step_keys_passes_the_known_keys_check() -> None:
    """``fp8.schedule.switches`` is keyed by step (int): the known-keys walk took every key as a
    str and failed on it (a KeyValidationError out of the launcher, not a ConfigError)."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(
            "job",
            overrides=[
                "trainer.precision=fp8",
                "++fp8.schedule.initial={layers.0.0:tensorwise}",
                "++fp8.schedule.switches={4:{layers.0.0:bf16}}",
            ],
        )
    check_known_keys(cfg)
    assert OmegaConf.to_container(cfg.fp8.schedule.switches) == {4: {"layers.0.0": "bf16"}}
