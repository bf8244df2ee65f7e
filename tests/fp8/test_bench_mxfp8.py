"""``python -m dscale.bench fp8 --only-mxfp8``: the MXFP8 arm against torchao alone, counted."""

from __future__ import annotations

import json
import subprocess
import sys


def test_mxfp8_benchmark_arm_equals_torchao_alone_bitwise_with_one_allreduce(tmp_path):
    """Oracle: torchao's MXFP8Linear by hand under FSDP2 (bf16 all-gather), same model, same
    batches; dscale's arm adds only the StepGuard's one all-reduce per step."""
    out = tmp_path / "mx.json"
    cmd = [sys.executable, "-m", "dscale.bench", "fp8", "--steps", "2", "--models", "mlp"]
    proc = subprocess.run(
        [*cmd, "--only-mxfp8", "--json", str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    arms = json.loads(out.read_text())["arms"]["mlp"]
    assert set(arms) == {"mxfp8_dscale", "mxfp8_torchao"}
    ours, theirs = arms["mxfp8_dscale"], arms["mxfp8_torchao"]
    assert ours["mxfp8_layers"] == theirs["mxfp8_layers"] == 2  # the MLP's two hidden linears
    assert ours["losses"] == theirs["losses"] and ours["losses_equal_torchao_bitwise"]
    assert (ours["collectives_per_step"], theirs["collectives_per_step"]) == (1, 0)
    assert "every step bitwise equal: True" in proc.stdout
