"""``trainer.precision=fp8`` under the real launcher: float8 linears, bf16 autocast, a StepGuard."""

from __future__ import annotations

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
