"""trainer.compile_step=true: the real 2-rank job with its post-backward region compiled.

The oracle is the same job uncompiled, run at the same time: the compiled job must skip the same
steps on both ranks, walk the same scale trace, log the same metrics rows and progress lines,
write its checkpoints, and train to the same losses (within AdamW's compiled-vs-eager last bits:
torch's compiled foreach AdamW differs from eager even with backend="eager", NOTES-compile.md).
On main (2cac85f) the key does not exist and Hydra refuses the job.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from launch_helpers import CONFIGS, FAST, Launched, free_port_pair, output, summary
from omegaconf import OmegaConf

from launch.schema import JobConfig, register
from launch.validate import ConfigError, validate

register()

JOB = [
    *FAST,
    "model=mlp",
    "trainer.max_steps=12",
    "scaler.growth_interval=3",  # the scale grows several times in 12 steps
    "scaler.sync_free=true",  # what the compiled region needs (the eager job takes it too)
    "fault.inf_steps=[4,9]",
    "fault.inf_rank=1",
]


def _rows(run_dir: Path, name: str) -> list[dict[str, Any]]:
    text = (run_dir / "metrics" / name).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _progress_shapes(stdout: str) -> list[str]:
    """The progress lines with their numbers blanked: the same words in the same places."""
    lines = [line for line in stdout.splitlines() if re.search(r"step \d+/\d+ loss", line)]
    lines = [re.sub(r"\bETA (\d+m)?\d+s", "ETA T", line) for line in lines]
    return [re.sub(r"\d[\d,]*(\.\d+)?(e[-+]?\d+)?", "N", line) for line in lines]


def test_compiled_step_job_equals_the_same_job_uncompiled(tmp_path: Path) -> None:
    eager_dir, compiled_dir = tmp_path / "eager", tmp_path / "compiled"
    eager = Launched(eager_dir, *JOB, f"metrics.port={free_port_pair()}")
    compiled = Launched(
        compiled_dir,
        *JOB,
        "trainer.compile_step=true",
        "trainer.compile_backend=eager",  # dynamo traces the whole region; torch runs it (fast)
        f"metrics.port={free_port_pair()}",
    )
    procs = {"eager": eager.finish(), "compiled": compiled.finish()}
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}: {output(proc)}"
    ours, oracle = summary(compiled_dir), summary(eager_dir)
    assert [r["skipped_steps"] for r in ours["ranks"]] == [[4, 9], [4, 9]]
    assert [r["skipped_steps"] for r in oracle["ranks"]] == [[4, 9], [4, 9]]
    assert [r["final_scale"] for r in ours["ranks"]] == [r["final_scale"] for r in oracle["ranks"]]
    for key in ("first_loss", "final_loss"):
        assert ours["result"][key] == pytest.approx(oracle["result"][key], rel=1e-4), key
    for rank in (0, 1):
        got, want = _rows(compiled_dir, f"rank{rank}.jsonl"), _rows(eager_dir, f"rank{rank}.jsonl")
        assert len(got) == len(want) == 12
        for column in ("step", "scale", "skipped", "growths", "backoffs", "clean_steps"):
            assert [r[column] for r in got] == [r[column] for r in want], (rank, column)
        # the numerics stats (observers run around the region): the applied steps' grad norms
        assert [r["grad_norm"] is None for r in got] == [r["grad_norm"] is None for r in want]
        for g, w in zip(got, want, strict=True):
            if w["grad_norm"] is not None:
                assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-3), (rank, g)
            assert g["loss"] == pytest.approx(w["loss"], rel=1e-4), (rank, g)
    # The scale trace itself moved: back-offs at 4 and 9, growths in between.
    last = _rows(compiled_dir, "rank0.jsonl")[-1]
    assert last["backoffs"] == 2 and last["growths"] >= 2, last
    shapes = _progress_shapes(procs["compiled"].stdout + procs["compiled"].stderr)
    assert shapes, output(procs["compiled"])
    assert shapes == _progress_shapes(procs["eager"].stdout + procs["eager"].stderr)
    for run_dir in (compiled_dir, eager_dir):
        assert (run_dir / "checkpoints" / "step-10").is_dir()
        assert (run_dir / "checkpoints" / "step-12").is_dir()


def _job(*overrides: str) -> JobConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("job", overrides=["checkpoint.dir=/tmp/dscale-compile-bad", *overrides])
    job = OmegaConf.to_object(cfg)
    assert isinstance(job, JobConfig)
    return job


def test_compile_step_refuses_what_cannot_compile_before_any_worker() -> None:
    """A host-decision scaler, fp8's step callbacks, and the backend key without the step key
    are refused by name, with what to set."""
    typed = ["trainer.compile_step=true", "metrics.enabled=false"]
    with pytest.raises(ConfigError, match=r"needs scaler\.sync_free=true.*add scaler\.sync_free"):
        validate(_job(*typed), typed)
    typed = [
        "trainer.precision=fp8",
        "trainer.compile_step=true",
        "scaler.sync_free=true",
        "metrics.enabled=false",
    ]
    with pytest.raises(ConfigError, match=r"set fp8\.numerics_every=0, or trainer\.compile_step"):
        validate(_job(*typed), typed)
    typed = ["trainer.compile_backend=eager", "metrics.enabled=false"]
    with pytest.raises(ConfigError, match=r"trainer\.compile_backend=eager is read only with "):
        validate(_job(*typed), typed)
