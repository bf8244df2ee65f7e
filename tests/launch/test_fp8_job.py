"""``trainer.precision=fp8`` under the real launcher: float8 linears, bf16 autocast, a StepGuard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch_helpers import FAST, free_port_pair, launch, output, summary, worker_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_fp8_job_trains_float8_linears_and_every_rank_skips_rank_1s_overflow(
    parallel: str, tmp_path: Path
) -> None:
    proc = launch(
        tmp_path,
        *FAST,
        "trainer.precision=fp8",
        f"parallel={parallel}",
        "model=mlp",
        "trainer.max_steps=12",
        "fault.inf_steps=[4]",
        "fault.inf_rank=1",
        f"metrics.port={free_port_pair()}",
    )
    assert proc.returncode == 0, output(proc)
    s = summary(tmp_path)
    assert [r["skipped_steps"] for r in s["ranks"]] == [[4], [4]]
    assert s["result"]["final_loss"] < s["result"]["first_loss"]
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "fp8: 2 float8 linears (tensorwise recipe)" in log  # the MLP's two hidden layers
    assert worker_config(tmp_path, 1)["fp8"]["keep_high_precision"] == ["head"]
    assert (tmp_path / "checkpoints" / "step-12").is_dir()


def _rows(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "metrics" / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _rows(run_dir, "rank0.jsonl")}


# fsdp: FSDP2 float8 all-gather with WeightScales; ddp: the fallback (which leaves float8
# all-gathered layers alone), its threshold low enough that layers fall within the first steps.
PARTS = {
    "fsdp": ["parallel=fsdp", "fp8.float8_all_gather=true", "fp8.predict=exact"],
    "ddp": [
        "parallel=ddp",
        "fp8.fallback=true",
        "fp8.fallback_threshold=1e-6",
        "fp8.fallback_samples=1",
    ],
}


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_fp8_job_uses_dscale_fp8_and_its_resume_equals_the_uninterrupted_run(
    parallel: str, tmp_path: Path
) -> None:
    common = [
        "trainer.precision=fp8",
        "model=mlp",
        "trainer.log_every=4",
        "data.seq_len=32",
        "trainer.max_steps=8",
        "checkpoint.every=4",
        "fp8.numerics_every=3",  # samples 0, 3, 6: a resume at 4 must keep the schedule
        *PARTS[parallel],
    ]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    proc = launch(whole, *common, f"metrics.port={free_port_pair()}")
    assert proc.returncode == 0, output(proc)
    proc = launch(
        resumed,
        *common,
        f"checkpoint.resume={whole / 'checkpoints' / 'step-4'}",
        f"metrics.port={free_port_pair()}",
    )
    assert proc.returncode == 0, output(proc)
    assert summary(resumed)["ranks"][0]["resumed_from"] == 4
    log = (whole / "logs" / "rank0.log").read_text()
    if parallel == "fsdp":
        assert "weight scales agreed in the step's collective (exact)" in log
    else:
        assert "fallback on" in log
    # The uninterrupted run's losses, bit for bit, at every step after the resume.
    ref, got = _losses(whole), _losses(resumed)
    assert sorted(got) == [4, 5, 6, 7]
    assert all(got[s] == ref[s] for s in got), (ref, got)
    # The numerics: sampled on the same steps (the schedule resumed), with the same values.
    for rank in (0, 1):
        ref_fp8 = _rows(whole, f"fp8-rank{rank}.jsonl")
        got_fp8 = _rows(resumed, f"fp8-rank{rank}.jsonl")
        assert [r["step"] for r in ref_fp8] == [0, 3, 6]
        assert got_fp8 == [r for r in ref_fp8 if r["step"] >= 4]
        assert set(got_fp8[0]["layers"]) == {  # the MLP's two float8 linears
            f"layers.0.{i}/{t}" for i in (0, 2) for t in ("input", "weight", "grad_output")
        }
    if parallel == "ddp":  # the fallen layers came back switched (bit-equal losses show it too)
        fell = [line for line in log.splitlines() if "runs in high precision from now on" in line]
        assert fell, log
