"""FP8 state travels with the scaler through dscale.checkpoint; a resume is the uninterrupted run.

2 gloo ranks, FSDP2 float8 all-gather, WeightScales and Float8Numerics (and, under DDP,
Float8Numerics with Float8Fallback). The oracle is the uninterrupted run in the same spawn: a
checkpoint saved at step 3 and loaded into a model built with other weights reproduces its
losses, scales and FP8 samples bit for bit, whether or not ``extra=`` names the FP8 state when
saving or loading (issue 41 item 6: on d4d559b a load without ``extra=`` changed the losses).
WeightScales state is keyed by layer name and shape (item 5): another conversion with as many
float8 layers is refused, naming the layers, and nothing changes.
"""

from __future__ import annotations

import pytest
import torch

from tests.fp8 import _resume_ranks
from tests.multirank import run_ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fp8-resume")
    out = run_ranks(_resume_ranks.scenarios, str(directory), timeout_s=600.0)
    out["one"] = run_ranks(_resume_ranks.resume_on_one_rank, str(directory), world_size=1)[0]
    return out


def test_resume_without_naming_the_fp8_state_is_bitwise_the_uninterrupted_run_fsdp2(runs):
    for rank in (0, 1):
        run = runs[rank]["resume"]
        assert run["first"] == run["whole"][:3]
        # losses, weight scales, numerics samples and snapshots, bit for bit
        assert run["resumed"] == run["whole"][3:]


def test_naming_the_fp8_state_in_extra_still_works_and_loads_once_fsdp2(runs):
    for rank in (0, 1):
        run = runs[rank]["resume"]
        for name in ("named_saved", "named_both", "named_load"):
            assert run[name] == run["whole"][3:], name
            assert run[name + "_loads"] == 1, name  # no double load


def test_a_checkpoint_without_the_fp8_state_is_refused_with_the_fix_fsdp2(runs):
    for rank in (0, 1):
        run = runs[rank]["resume"]
        assert "holds no fp8_weight_scales state" in run["bare"], run["bare"]
        assert "build the WeightScales after load_checkpoint()" in run["bare"]
        assert run["bare_unchanged"]


def test_weight_scales_of_other_layers_are_refused_naming_them_fsdp2(runs):
    for rank in (0, 1):
        run = runs[rank]["mismatched"]
        saved, here = run["layers"]
        assert len(saved) == len(here) == 3 and saved != here
        for key in ("checkpoint", "direct"):
            assert "in the state, not in this model: ['blocks.1.fc2']" in run[key], run[key]
            assert "in this model, not in the state: ['blocks.0.fc1']" in run[key], run[key]
        assert run["checkpoint"].startswith("CheckpointError")
        assert "keyed by name" in run["old_format"], run["old_format"]
        assert run["unchanged"]  # model, optimizer and scales as they were
        assert "other weight shapes" in run["shapes"], run["shapes"]
        assert "blocks.0.fc2: (32, 64) saved, (32, 128) here" in run["shapes"]


def test_weight_scales_refuse_a_model_without_float8_all_gather_on_every_rank_fsdp2(runs):
    for rank in (0, 1):
        message = runs[rank]["mismatched"]["no_all_gather"]
        assert message.startswith("ValueError") and "without float8 all-gather" in message


def test_the_fallback_and_numerics_travel_with_the_scaler_ddp(runs):
    for rank in (0, 1):
        run = runs[rank]["fallback"]
        assert run["resumed"] == run["whole"][2:]  # losses and switched layers, per step
        assert any(fell for _, fell in run["whole"][2:])  # the layer falls after the resume


def test_a_two_rank_checkpoint_on_one_rank_casts_with_the_same_scales(runs):
    # The forward depends on the weights and the scales only: rank 0's loss of the
    # uninterrupted 2-rank run at step 3, bit for bit.
    whole = runs[0]["resume"]["whole"]
    assert runs["one"]["scales"] == whole[2][1]  # the scales step 3's forward cast with
    assert runs["one"]["loss"] == whole[3][0]


def test_loading_another_models_scales_is_refused_and_changes_nothing():
    from dscale.fp8 import WeightScales

    scales = WeightScales.__new__(WeightScales)
    scales.names = ("a", "b")
    scales._shapes = [(16, 16), (16, 16)]
    scales.scales = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="keyed by name"):
        scales.load_state_dict({"scales": torch.ones(3), "num_layers": 3})
    state = {
        "names": torch.tensor(list(b"a\nc"), dtype=torch.uint8),
        "shapes": torch.tensor([[16, 16], [16, 16]]),
        "scales": torch.ones(2),
        "ratio_sq": torch.zeros(2, dtype=torch.float64),
        "steps": torch.zeros(2, dtype=torch.float64),
    }
    with pytest.raises(ValueError, match=r"in the state, not in this model: \['c'\]"):
        scales.load_state_dict(state)
    assert scales.scales.tolist() == [1.0, 2.0]
