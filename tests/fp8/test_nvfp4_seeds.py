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
from dscale.fp8 import _nvfp4_prepare
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
    ranks = [_nvfp4_prepare.prepare(model, rank=r) for r in (0, 1, 0)]
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
    assert model.fc.rht_sign_vector == tuple(_nvfp4_prepare.sign_vector("fc", 0))


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
    for name, module in _nvfp4_prepare.nvfp4_layers(model):
        assert (module.rht_sign_vector, int(module._sr_seed)) == saved[name]
    assert seeds.seed == 0  # the saved run's


# ---------------------------------------------------------------- review r43d: attacks


def test_ranks_holding_other_nvfp4_layers_are_refused_at_construction_on_every_rank(runs):
    """Rank 1 kept a layer in high precision: before, the first step's vector was 13 floats on
    rank 0 and 8 on rank 1 and gloo aborted rank 1 ("Received data size doesn't match"); a
    rank with no NVFP4 layer raised alone, leaving rank 0 in the collective."""
    for rank in (0, 1):
        out = runs[rank]["attacks"]
        assert out["other_layers"].startswith("LayoutMismatchError")
        assert "only here: ['2 (128->128)']" in out["other_layers"]
        assert out["none_on_1"].startswith("ValueError: NVFP4Seeds refused on rank(s) rank 1")


def test_nvfp4seeds_built_before_init_process_group_is_refused_at_the_first_step(runs):
    """Built before init (every rank is rank 0 then), every rank held rank 0's SR seeds and the
    check passed: the stochastic rounding correlated across ranks, silently."""
    a, b = runs[0]["attacks"], runs[1]["attacks"]
    assert a["before_init_seeds"] == b["before_init_seeds"]  # what the check must catch
    for out in (a, b):
        assert out["before_init"].startswith("LayoutMismatchError")
        assert "before init_process_group" in out["before_init"]


def test_signs_other_than_plus_minus_one_after_a_load_are_refused_on_every_rank(runs):
    """A model state whose signs are 0 (loaded alike on every rank) passed the agreement check:
    a zero sign zeroes the Hadamard transform."""
    for rank in (0, 1):
        out = runs[rank]["attacks"]["zero_signs"]
        assert out.startswith("LayoutMismatchError") and "other than -1 and +1" in out
        assert "['0']" in out


def test_another_runs_model_state_loaded_on_rank_1_alone_is_refused_on_every_rank(runs):
    """model.load_state_dict of a state made with other signs, on rank 1 only: the load re-arms
    the check, and every rank raises before the step (no finding: v43d did this too)."""
    for rank in (0, 1):
        out = runs[rank]["attacks"]
        assert out["other_run_on_1"].startswith("LayoutMismatchError")
        assert "sign vectors of ['0', '2'] differ" in out["other_run_on_1"]
        assert out["other_run_unchanged"]


def test_the_check_rides_the_deferred_collective_of_torchs_amp_recipe_on_gradscaler(runs):
    """GradScaler, two micro-batches, unscale_ + clip_grad_norm_ on one of two optimizers: rank
    1's changed signs refused on every rank at the first optimizer's step, nothing stepped (no
    finding: v43d did this too)."""
    for rank in (0, 1):
        out = runs[rank]["attacks"]
        assert out["amp_recipe"].startswith("LayoutMismatchError")
        assert "sign vectors of ['0'] differ" in out["amp_recipe"]
        assert out["amp_unchanged"]


def test_fsdp2_keeps_each_ranks_sr_seeds_and_a_resume_gives_each_its_own_back(runs):
    """fully_shard leaves the buffers plain and unbroadcast; the first step passes the check;
    dscale.checkpoint brings each rank's own seeds back over seeds overwritten with 5 (no
    finding)."""
    a, b = runs[0]["attacks"], runs[1]["attacks"]
    assert a["fsdp_applied"] and b["fsdp_applied"]
    for name in a["fsdp_used"]:
        assert a["fsdp_used"][name][0] == b["fsdp_used"][name][0]
        assert a["fsdp_used"][name][1] != b["fsdp_used"][name][1]
        for out in (a, b):
            assert out["fsdp_loaded"][name] == out["fsdp_used"][name]


def test_a_ddp_built_before_the_conversion_is_accepted_and_keeps_per_rank_seeds(runs):
    """DDP broadcasts the buffers it listed at construction: the swapped layers' SR seeds are
    not among them (each rank's own below), so NVFP4Seeds on that DDP is no longer refused."""
    a, b = runs[0]["attacks"], runs[1]["attacks"]
    assert a["ddp_before"] == b["ddp_before"] == "no error"
    assert a["ddp_before_applied"] and b["ddp_before_applied"]
    for name in a["ddp_before_used"]:
        assert a["ddp_before_used"][name][0] == b["ddp_before_used"][name][0]
        assert a["ddp_before_used"][name][1] != b["ddp_before_used"][name][1]


def test_nvfp4_slots_ride_the_one_collective_first_step_and_first_after_a_load_only(runs):
    """One all-reduce per step; 5 slots per layer (2 layers) on the first step and on the first
    after load_checkpoint, the flag alone otherwise (iteration 2 carries no scale range)."""
    for rank in (0, 1):
        out = runs[rank]["attacks"]
        assert out["widths"] == [3 + 10, 1]
        assert out["widths_after_load"] == [1 + 10, 1]


def _seeded(seed: int = 0):
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128, bias=False))
    fp8.convert_to_float8(model, recipe="nvfp4")
    guard = dscale.StepGuard("cpu")
    seeds = fp8.NVFP4Seeds(model, guard, seed=seed)
    return model, guard, seeds, torch.optim.SGD(model.parameters(), lr=0.1)


def _tampered(state, what):
    if what == "short sign rows":
        state["sign_vectors"] = state["sign_vectors"][:1]
    elif what == "zero signs":
        state["sign_vectors"] = torch.zeros_like(state["sign_vectors"])
    elif what == "short sr row":
        state["sr_seeds"]["rank_0"] = state["sr_seeds"]["rank_0"][:1]
    return state


def test_a_tampered_or_missing_fp8_nvfp4_entry_is_refused_before_anything_loads(tmp_path):
    """Before, rows shorter than the layers passed the check and raised KeyError in the middle
    of applying (the model already loaded), and signs of 0 loaded silently."""
    from dscale.checkpoint import CheckpointError, CheckpointManager, load_checkpoint

    kinds = ("short sign rows", "zero signs", "short sr row")
    for step, what in enumerate(kinds, 1):
        model, guard, seeds, _ = _seeded()
        state = seeds.state_dict
        seeds.state_dict = lambda state=state, what=what: _tampered(state(), what)
        CheckpointManager(tmp_path / f"t{step}", every=0).save(1, model=model, scaler=guard)
        seeds.close()
    model, _, _, _ = _seeded()
    CheckpointManager(tmp_path / "bare", every=0).save(1, model=model)  # no fp8_nvfp4 entry
    model, guard, seeds, _ = _seeded(seed=5)
    with torch.no_grad():
        model[0].weight.fill_(0.5)  # unlike every saved model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(1, len(kinds) + 1):
        with pytest.raises(CheckpointError, match="damaged"):
            load_checkpoint(tmp_path / f"t{step}" / "step-1", model=model, scaler=guard)
    with pytest.raises(CheckpointError, match="holds no fp8_nvfp4 state"):
        load_checkpoint(tmp_path / "bare" / "step-1", model=model, scaler=guard)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert seeds.seed == 5


def test_nvfp4seeds_refuses_meta_buffers_and_a_second_live_one_on_the_same_layers(caplog):
    """A model converted on the meta device got no signs (to_empty() left garbage: signs of 0
    or -84); NVFP4Seeds on it wrote nothing. A second NVFP4Seeds on the same layers silently
    overwrote the first's SR seeds."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))
    with caplog.at_level("WARNING", logger="dscale.fp8._nvfp4_prepare"):
        fp8.convert_to_float8(model, recipe="nvfp4")
    assert "on the meta device" in caplog.text
    guard = dscale.StepGuard("cpu")
    with pytest.raises(ValueError, match="meta device"):
        fp8.NVFP4Seeds(model, guard)
    model.to_empty(device="cpu")
    first = fp8.NVFP4Seeds(model, guard)
    assert model[0].rht_sign_vector == tuple(_nvfp4_prepare.sign_vector("0", 0))
    with pytest.raises(ValueError, match="already set by another live NVFP4Seeds"):
        fp8.NVFP4Seeds(model, guard, seed=1)
    assert int(model[0]._sr_seed) == _nvfp4_prepare.sr_seed("0", 0, 0)  # the first's, untouched
    first.close()
    fp8.NVFP4Seeds(model, guard, seed=1).close()
    assert model[0].rht_sign_vector == tuple(_nvfp4_prepare.sign_vector("0", 1))


def test_one_process_refuses_signs_other_than_plus_minus_one_before_the_step():
    """Without a collective, verify() was never called: a one-process job that loaded a state
    with signs of 0 trained on (a zeroed Hadamard transform). Refused now, nothing stepped."""
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))
    fp8.convert_to_float8(model, recipe="nvfp4")
    for _, layer in _nvfp4_prepare.nvfp4_layers(model):
        layer.forward = lambda x, m=layer: torch.nn.functional.linear(x, m.weight, m.bias)
    guard = dscale.StepGuard("cpu")
    seeds = fp8.NVFP4Seeds(model, guard)
    state = model.state_dict()
    state["2._rht_sign_vector"] = torch.zeros(16, dtype=torch.int8)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    guard.scale(model(torch.randn(4, 128)).sum()).backward()
    with pytest.raises(fp8.LayoutMismatchError, match=r"sign vectors of \['2'\]"):
        guard.step(opt)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    seeds.close()


def test_nvfp4_leaves_what_torchao_cannot_take_in_conversion_left_and_swaps_a_shared_linear_once():
    """Review r43d (no finding): a Linear subclass and dims not divisible by 128 are named in
    ``conversion.left``; a bias-less linear is converted; a linear held under two names becomes
    one NVFP4Linear held under both (one sign vector, one SR seed, one ignore entry)."""

    class Sub(nn.Linear):
        pass

    model = nn.Module()
    model.a = nn.Linear(128, 128)
    model.b = model.a
    model.s = Sub(128, 128)
    model.odd = nn.Linear(128, 96)
    model.nb = nn.Linear(256, 128, bias=False)
    conversion = fp8.convert_to_float8(model, recipe="nvfp4")
    assert conversion.converted == ("a", "nb")
    assert sorted(conversion.left) == ["odd", "s"]
    assert "subclass" in conversion.left["s"] and "divisible by 128" in conversion.left["odd"]
    assert model.a is model.b and type(model.a).__name__ == "NVFP4Linear"
    assert model._ddp_params_and_buffers_to_ignore == ["a._sr_seed", "nb._sr_seed"]
    assert [n for n, _ in _nvfp4_prepare.nvfp4_layers(model)] == ["a", "nb"]


def test_a_model_with_nvfp4seeds_can_be_saved_whole_and_copied_and_the_copy_is_its_own():
    """torch.save(model) raised "Can't pickle local object 'GradScaler.add_agreement_field.
    <locals>.unregister'": the load hook was a bound method dragging NVFP4Seeds and its scaler
    along. The loaded copy keeps the buffers; loading a state into it leaves the original's
    NVFP4Seeds alone (its layers are not the copy's)."""
    import copy
    import io

    model = nn.Sequential(nn.Linear(128, 128))
    fp8.convert_to_float8(model, recipe="nvfp4")
    seeds = fp8.NVFP4Seeds(model, dscale.StepGuard("cpu"))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for twin in (loaded, copy.deepcopy(model)):
        assert twin[0].rht_sign_vector == model[0].rht_sign_vector
        assert int(twin[0]._sr_seed) == int(model[0]._sr_seed)
        seeds._pending = False
        twin.load_state_dict(model.state_dict())
        assert not seeds._pending  # the original's check is not re-armed by the copy's load
    model.load_state_dict(model.state_dict())
    assert seeds._pending  # its own model's load still is
    seeds.close()


def test_converted_before_init_process_group_under_torchrun_the_sr_seeds_are_this_ranks(
    monkeypatch,
):
    """torchrun sets RANK before the script calls init_process_group; a conversion (or
    NVFP4Seeds) made before init used rank 0's SR seeds on every rank, silently when no
    NVFP4Seeds followed. Now RANK is read until the process group exists."""
    monkeypatch.setenv("RANK", "1")
    model = _model(0)
    fp8.convert_to_float8(model, recipe="nvfp4")
    assert (
        int(model[0]._sr_seed)
        == _nvfp4_prepare.sr_seed("0", 0, 1)
        != _nvfp4_prepare.sr_seed("0", 0, 0)
    )
    seeds = fp8.NVFP4Seeds(model, dscale.StepGuard("cpu"))
    assert seeds.rank == 1 and int(model[2]._sr_seed) == _nvfp4_prepare.sr_seed("2", 0, 1)
    seeds.close()
