"""A resume of FP8 training with agreed weight scales is bitwise the uninterrupted run.

2 gloo ranks, FSDP2 float8 all-gather, WeightScales; saved at step 3 through dscale.checkpoint
(``extra={"fp8_weight_scales": scales}``), loaded into a model built with other weights. The
negative control loads everything but the scales: the weights then cast with fresh exact scales,
not the bound's, and the losses differ, which shows the scales must be in the checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from dscale.fp8 import WeightScales
from tests.fp8 import _resume_ranks
from tests.multirank import run_ranks


def test_resume_is_bitwise_the_uninterrupted_run_fsdp2(tmp_path):
    out = run_ranks(_resume_ranks.resume, str(tmp_path), timeout_s=600.0)
    for rank in (0, 1):
        run = out[rank]
        assert run["first"] == run["whole"][:3]
        assert run["resumed"] == run["whole"][3:]  # losses and scales, bit for bit
        assert [loss for loss, _ in run["without_scales"]] != [x for x, _ in run["whole"][3:]]
    # 2 ranks -> 1: the same checkpoint on one rank casts step 3's forward with the same scales
    # and gives rank 0's loss of the uninterrupted 2-rank run, bit for bit (the forward depends
    # on the weights and the scales only).
    one = run_ranks(_resume_ranks.resume_on_one_rank, str(tmp_path), world_size=1)[0]
    whole = out[0]["whole"]
    assert one["scales"] == whole[2][1]  # the scales step 3's forward cast with
    assert one["loss"] == whole[3][0]


def test_loading_another_models_scales_is_refused_and_changes_nothing():
    scales = WeightScales.__new__(WeightScales)
    scales.names = ("a", "b")
    scales.scales = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="2 float8 all-gather layers"):
        scales.load_state_dict({"scales": torch.ones(3), "num_layers": 3})
    assert scales.scales.tolist() == [1.0, 2.0]
