"""An fp8 job with the fallback, resumed at a step that is not sampled, switches what the
uninterrupted job switches (issue 41 item 9, under the real launcher).

``fp8.fallback_samples=3``: a layer runs in high precision after 3 samples in a row above the
threshold. Samples at steps 0, 3, 6 (``fp8.numerics_every=3``); the checkpoint at step 4 is
between samples. The fallback once zeroed its runs at the first resumed step, so the resumed job
switched nothing at step 6 and trained step 7 otherwise. Oracle: the uninterrupted job, bit for
bit (losses at steps 4-7, the layers switched, the FP8 samples).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from launch_helpers import free_port_pair, launch, output, summary

pytestmark = pytest.mark.slow

FELL = re.compile(r"Float8Fallback: (\S+) runs in high precision from now on")


def _rows(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "metrics" / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_fp8_fallback_resumed_between_samples_switches_the_layers_of_the_uninterrupted_job_ddp(
    tmp_path: Path,
) -> None:
    common = [
        "trainer.precision=fp8",
        "parallel=ddp",
        "model=mlp",
        "trainer.log_every=4",
        "data.seq_len=32",
        "trainer.max_steps=8",
        "checkpoint.every=4",
        "fp8.numerics_every=3",
        "fp8.fallback=true",
        "fp8.fallback_threshold=1e-6",  # every sample passes: layers fall at the 3rd, step 6
        "fp8.fallback_samples=3",
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
    for rank in (0, 1):
        fell = FELL.findall((whole / "logs" / f"rank{rank}.log").read_text())
        assert fell, "the uninterrupted job switched no layer: the test shows nothing"
        assert FELL.findall((resumed / "logs" / f"rank{rank}.log").read_text()) == fell, rank
        ref = {r["step"]: r["loss"] for r in _rows(whole, f"rank{rank}.jsonl")}
        got = {r["step"]: r["loss"] for r in _rows(resumed, f"rank{rank}.jsonl")}
        assert sorted(got) == [4, 5, 6, 7]
        assert all(got[s] == ref[s] for s in got), (rank, ref, got)
        ref_fp8 = _rows(whole, f"fp8-rank{rank}.jsonl")
        assert [r["step"] for r in ref_fp8] == [0, 3, 6]
        assert _rows(resumed, f"fp8-rank{rank}.jsonl") == [r for r in ref_fp8 if r["step"] >= 4]
