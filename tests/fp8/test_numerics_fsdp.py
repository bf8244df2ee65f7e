"""Float8Numerics under FSDP2 measures what the GEMM multiplies: the gathered weight.

2 gloo ranks, inside the FP8 tests' one spawn (tests/fp8/_mx_spawn.py). Oracle: the same model
on one process, run on each rank's batch; the worst rank's sample must equal, field by field,
the largest of those runs' (for the weight, which both runs share: the unsharded weight's).
"""

from __future__ import annotations

import pytest

from tests.fp8 import _fsdp_numerics, _mx_spawn


@pytest.mark.parametrize("recipe", _fsdp_numerics.RECIPES)
def test_fsdp2_numerics_equal_the_unsharded_model_on_one_process(recipe: str) -> None:
    """Tensorwise, rowwise and MXFP8 with FSDP2's high-precision all-gather: every layer's
    input, weight and grad_output fields (and scale) on both ranks equal the one-process
    oracle's exactly; before the fix the weight's were this rank's shard's (amax agreed, but
    the shares and, tensorwise, the scale of a half-tensor)."""
    out = {rank: r["fsdp_numerics"][recipe] for rank, r in _mx_spawn.results().items()}
    want = _fsdp_numerics.oracle(recipe)
    assert out[0] == out[1]
    assert set(out[0]) == set(want)
    for key in sorted(want):
        assert out[0][key] == pytest.approx(want[key], rel=0, abs=0), key
    weight = want["blocks.0.fc1/weight"]
    assert weight["flushed"] > 0  # the outlier's (not vacuous)


def test_fsdp2_float8_all_gather_weight_numerics_are_the_worst_shards() -> None:
    """Tensorwise with float8 all-gather: the gathered weight arrives already cast, so the
    weight is measured on this rank's shard under the cast's scale: amax and scale equal the
    unsharded weight's, and the shares are the worst shard's (at least the whole's, for even
    shards); input and grad_output equal the oracle's."""
    out = _mx_spawn.results()[0]["fsdp_numerics"]["tensorwise_f8ag"]
    want = _fsdp_numerics.oracle("tensorwise")
    for key, row in want.items():
        if key.endswith("/weight"):
            assert out[key]["amax"] == row["amax"] and out[key]["scale"] == row["scale"], key
            # (saturated too: the dynamic scale is torchao's amax_to_scale, as the cast's is)
            for f in ("saturated", "flushed", "subnormal"):
                assert out[key][f] >= row[f], (key, f)
        else:
            assert out[key] == pytest.approx(row, rel=0, abs=0), key
