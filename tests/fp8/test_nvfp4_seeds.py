"""NVFP4 readiness: Hadamard signs alike on every rank, SR seeds per rank, checked and saved.

torchao 0.18's NVFP4Linear draws its 16 Hadamard signs and its stochastic-rounding seed at random
per module per process. The oracle for each claim is torchao alone in the same spawn: under DDP
its SR seeds become rank 0's, its signs differ between ranks and the kernels keep a stale copy of
them; a checkpoint of the model alone gives every rank one rank's SR seeds.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import dscale
import dscale.fp8 as fp8
from dscale.fp8 import _nvfp4
from tests.fp8._nvfp4_ranks import scenarios
from tests.multirank import run_ranks


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return tmp_path_factory.mktemp("nvfp4")


@pytest.fixture(scope="module")
def runs(directory):
    return run_ranks(scenarios, str(directory))


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128), nn.Linear(128, 10))


def test_nvfp4_conversion_keeps_the_parameters_and_sets_the_signs_from_the_layer_names():
    """Two constructions (other torch seeds) get the same signs per layer, where torchao's own
    draws differ; parameters are moved, not copied; a layer torchao cannot take is left."""
    from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear

    models = [_model(seed) for seed in (0, 1)]
    weights = [m[0].weight for m in models]
    conversions = [fp8.convert_to_float8(m, recipe="nvfp4") for m in models]
    assert conversions[0].converted == ("0", "2")
    assert "divisible by 128" in conversions[0].left["3"]
    assert all(isinstance(m[0], NVFP4Linear) and m[0].weight is w for m, w in zip(models, weights))
    assert models[0][0].rht_sign_vector == models[1][0].rht_sign_vector
    assert models[0][0].rht_sign_vector != models[0][2].rht_sign_vector  # per layer
    assert tuple(models[0][0]._rht_sign_vector.tolist()) == models[0][0].rht_sign_vector
    assert models[0]._ddp_params_and_buffers_to_ignore == ["0._sr_seed", "2._sr_seed"]
    torch.manual_seed(0)
    draws = [NVFP4Linear(128, 128).rht_sign_vector for _ in range(8)]
    assert len(set(draws)) > 1  # torchao alone: a random basis per module


def test_sr_seeds_differ_per_rank_and_repeat_for_the_same_rank():
    model = _model(0)
    fp8.convert_to_float8(model, recipe="nvfp4")
    ranks = [_nvfp4.prepare(model, rank=r) for r in (0, 1, 0)]
    assert sorted(ranks[0]) == ["0", "2"]
    assert ranks[0] == ranks[2]
    assert all(ranks[0][n] != ranks[1][n] for n in ranks[0])
    assert int(model[0]._sr_seed) == ranks[0]["0"]  # the buffer holds the last one written


def test_nvfp4_refuses_emulate_and_nvfp4seeds_refuses_a_model_without_nvfp4_layers():
    with pytest.raises(ValueError, match="no emulation"):
        fp8.convert_to_float8(_model(0), recipe="nvfp4", emulate=True)
    with pytest.raises(ValueError, match="no torchao NVFP4Linear"):
        fp8.NVFP4Seeds(_model(0), dscale.StepGuard("cpu"))


def test_torchao_alone_under_ddp_shares_rank_0s_sr_seeds_and_keeps_stale_signs(runs):
    """The negative control: what NVFP4Seeds prevents."""
    a, b = runs[0]["torchao"], runs[1]["torchao"]
    for name in a["drawn"]:
        assert a["drawn"][name][1] != b["drawn"][name][1]  # drawn per rank
        assert b["used"][name][1] == a["used"][name][1]  # DDP: rank 0's SR seed on rank 1
        assert b["buffers"][name][0] == a["buffers"][name][0]  # the buffer broadcast...
        assert b["used"][name][0] != b["buffers"][name][0]  # ...but the kernels' copy stale


def test_prepared_before_ddp_signs_agree_and_sr_seeds_stay_per_rank_ddp(runs):
    a, b = runs[0]["prepared"], runs[1]["prepared"]
    assert a["applied"] == b["applied"] == [True, True]
    for name in a["used"]:
        assert a["used"][name][0] == b["used"][name][0] == a["buffers"][name][0]
        assert a["used"][name][1] != b["used"][name][1]  # each rank's own SR seed
        assert b["used"][name][1] == b["buffers"][name][1]
    # One collective per step: the first carries the flag, the scale range (3 slots) and 5
    # slots per layer; the next the flag alone.
    assert a["calls"] == b["calls"] == [3 + 5 * 2, 1]


def test_nvfp4seeds_on_a_ddp_that_broadcasts_buffers_is_refused_on_every_rank(runs):
    for rank in (0, 1):
        assert "broadcast_buffers=False" in runs[rank]["prepared"]["late"]


def test_nvfp4seeds_on_a_ddp_built_after_the_conversion_is_accepted_ddp(runs):
    """The launcher's order: convert (the SR seeds excluded from the broadcast), DDP, then
    NVFP4Seeds on the wrapper; the first step passes the check, each rank on its own seed."""
    a, b = runs[0]["prepared"]["after_ddp"], runs[1]["prepared"]["after_ddp"]
    assert a["applied"] and b["applied"]
    for name in a["used"]:
        assert a["used"][name][0] == b["used"][name][0]
        assert a["used"][name][1] != b["used"][name][1]


def test_signs_changed_on_rank_1_are_refused_on_every_rank_before_the_step(runs):
    for rank in (0, 1):
        out = runs[rank]["tampered"]
        assert out["error"].startswith("LayoutMismatchError")
        assert "['0', '2']" in out["error"]  # both layers named: the signs and the stale copy
        assert out["unchanged"]


def test_resume_gives_each_rank_its_own_sr_seeds_and_the_saved_signs(runs):
    a, b = runs[0]["resume"], runs[1]["resume"]
    for out in (a, b):
        assert out["other"] != out["saved"]  # seed=7 until loaded
        assert out["loaded"] == out["saved"]
        assert out["used"] == out["saved"]  # what the kernels read
        assert out["applied_after"]
    assert all(a["loaded"][n][1] != b["loaded"][n][1] for n in a["loaded"])
    # The model's state dict alone: DCP keeps one copy of the replicated buffer.
    assert a["bare_saved"] != b["bare_saved"]
    assert a["bare_loaded"] == b["bare_loaded"]


def test_launcher_refuses_nvfp4_without_a_gpu_before_any_worker_and_converts_with_it():
    """fp8.recipe=nvfp4 is a choice (the library's Literal); on this CPU it is refused before
    spawning, naming the key; the conversion itself (a GPU job's) builds NVFP4Linear with the
    signs and seeds set, and build_parts adds NVFP4Seeds (the first-step check, the state)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import launch.fp8
    from launch.schema import register
    from launch.validate import ConfigError, validate
    from tests.fp8.test_mxfp8_launch import CONFIGS

    register()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(
            "job",
            overrides=[
                "checkpoint.dir=/tmp/dscale-nvfp4",
                "metrics.enabled=false",
                "trainer.precision=fp8",
                "fp8.recipe=nvfp4",
            ],
        )
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"fp8\.recipe=nvfp4"):
            validate(OmegaConf.to_object(cfg))
    model = nn.Sequential(
        OrderedDict(fc=nn.Linear(128, 128), act=nn.ReLU(), head=nn.Linear(128, 128))
    )
    conversion = launch.fp8.convert(model, {"recipe": "nvfp4"}, torch.device("cpu"))
    assert conversion.converted == ("fc",)  # the head kept, as fp8.keep_high_precision says
    guard = dscale.StepGuard("cpu")
    parts = launch.fp8.build_parts(model, None, guard, conversion, {"recipe": "nvfp4"})
    assert isinstance(parts["fp8_nvfp4"], fp8.NVFP4Seeds)
    assert model.fc.rht_sign_vector == tuple(_nvfp4.sign_vector("fc", 0))


def test_a_two_rank_checkpoint_resumed_by_one_process_derives_its_seeds_and_keeps_the_signs(
    runs, directory
):
    """Another world size: no row is this rank's by right, so its SR seeds are derived anew
    from the saved seed (rank 0's as saved, here) and the saved signs are kept."""
    from dscale.checkpoint import load_checkpoint

    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128, bias=False))
    fp8.convert_to_float8(model, recipe="nvfp4")
    guard = dscale.StepGuard("cpu")
    seeds = fp8.NVFP4Seeds(model, guard, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    load_checkpoint(directory / "seeds" / "step-1", model=model, optimizer=opt, scaler=guard)
    saved = runs[0]["resume"]["saved"]
    for name, module in _nvfp4.nvfp4_layers(model):
        assert (module.rht_sign_vector, int(module._sr_seed)) == saved[name]
    assert seeds.seed == 0  # the saved run's
