"""``python -m dscale.bench fp8 --mxfp8``: the MXFP8 arms against torchao alone, counted.

The arms run inside the FP8 tests' one 2-rank spawn (tests/fp8/_mx_spawn.py) through the
benchmark's own ``run_here``; the command line is checked for its flags and its table.
"""

from __future__ import annotations

import pytest

from dscale.bench import _fp8_cli
from tests.fp8 import _mx_spawn


def test_mxfp8_benchmark_arm_equals_torchao_alone_bitwise_with_one_allreduce():
    """Oracle: torchao's MXFP8Linear put in by hand under FSDP2 (bf16 all-gather), same model
    and batches, stepped by the optimizer alone; dscale's arm adds only the StepGuard's one
    all-reduce per step."""
    result = _mx_spawn.results()[0]["bench"]
    arms = result["arms"]["mlp"]
    assert set(arms) == {"mxfp8_dscale", "mxfp8_torchao"}
    ours, theirs = arms["mxfp8_dscale"], arms["mxfp8_torchao"]
    assert ours["mxfp8_layers"] == theirs["mxfp8_layers"] == 2  # the MLP's two hidden linears
    assert ours["losses"] == theirs["losses"] and ours["losses_equal_torchao_bitwise"]
    assert (ours["collectives_per_step"], theirs["collectives_per_step"]) == (1, 0)
    table = _fp8_cli.render(result)
    assert "mlp MXFP8 (mxfp8, 2 layers, FSDP2 bf16 all-gather)" in table
    assert "every step bitwise equal: True" in table


def test_the_command_line_offers_the_mxfp8_arms(capsys):
    with pytest.raises(SystemExit):
        _fp8_cli.main(["--help"])
    text = capsys.readouterr().out
    assert "--mxfp8" in text and "--only-mxfp8" in text
