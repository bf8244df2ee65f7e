"""Review r43a of issue 43 items 1-2: what the MXFP8 conversion and the per-row/per-block
numerics did with layers and states a user hands them (each test failed on f43a's 44070ac).

Oracles: torchao's own MXFP8Linear put in by hand (bit for bit), the model's module structure
(the same object wherever it is held), and the saving run's recipe.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import dscale
import dscale.fp8 as fp8
from tests.fp8 import _models


class _Shared(nn.Module):
    """One linear held in two places (a shared block): ``a`` and ``b`` are the same module."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 32)
        self.b = self.a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("recipe", ["mxfp8", "tensorwise"])
def test_a_shared_linear_is_swapped_wherever_the_model_holds_it(recipe):
    """Before: only the first name (``a``) was swapped; ``b`` still held the nn.Linear, so the
    layer ran in float8 on one path and in high precision on the other, with no log line.
    Oracle: the converted module itself called on both paths (a layer is one module)."""
    model = _Shared()
    conv = fp8.convert_to_float8(model, recipe=recipe, emulate=True)
    assert conv.converted == ("a",) and conv.left == {}
    assert model.b is model.a and type(model.a) is not nn.Linear
    x = torch.randn(32, 32)
    one = model.a
    assert torch.equal(model(x), one(torch.relu(one(x))))


def test_a_shared_linear_kept_by_its_second_name_stays_in_high_precision_everywhere():
    """Before: keep_high_precision=["b"] was refused as naming no linear (named_modules()
    gives the shared module under its first name only)."""
    model = _Shared()
    conv = fp8.convert_to_float8(model, recipe="mxfp8", keep_high_precision=["b"], emulate=True)
    assert conv.converted == () and conv.left == {"a": "filter"}
    assert type(model.a) is nn.Linear and model.b is model.a


def test_linear_subclasses_are_left_with_a_log_line_and_a_reason(caplog):
    """Before: a subclass of nn.Linear (MultiheadAttention's out_proj, a parametrized linear)
    stayed in high precision silently: in neither converted nor left, no log line (issue 43:
    whatever torchao refuses is left with a log line naming it)."""
    from torch.nn.utils import parametrizations

    model = nn.Sequential(
        nn.MultiheadAttention(32, 2),
        parametrizations.weight_norm(nn.Linear(32, 32)),
        nn.Linear(32, 32),
    )
    with caplog.at_level(logging.INFO, logger="dscale.fp8._convert"):
        conv = fp8.convert_to_float8(model, recipe="mxfp8", emulate=True)
    assert conv.converted == ("2",)
    assert set(conv.left) == {"0.out_proj", "1"}
    assert "NonDynamicallyQuantizableLinear" in conv.left["0.out_proj"]
    assert "ParametrizedLinear" in conv.left["1"]
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "0.out_proj stays in high precision" in logged and "1 stays" in logged
    # A layer converted already is not "left in high precision": a second call lists nothing.
    again = fp8.convert_to_float8(model, recipe="mxfp8", emulate=True)
    assert again.converted == () and set(again.left) == {"0.out_proj", "1"}


def _numerics_state(recipe: str) -> dict:
    model = _models.net()
    fp8.convert_to_float8(model, recipe=recipe, emulate=True)  # type: ignore[arg-type]
    guard = dscale.StepGuard("cpu")
    opt = torch.optim.AdamW(model.parameters())
    numerics = fp8.Float8Numerics(model, guard, every=1)
    guard.scale(_models.loss_of(model, *_models.batch(0, size=2))).backward()
    guard.step(opt)
    guard.update()
    state = numerics.state_dict()
    numerics.close()
    return state


def test_a_numerics_state_of_another_recipe_is_refused_even_when_its_width_matches():
    """Before: a rowwise run's state (7 fields + scale per tensor) loaded silently into an
    MXFP8 model's Float8Numerics (also 7 + 1), its rows_saturated read back as blocks_clamped.
    Oracle: the saving run's recipe; the same recipe's state still loads."""
    rowwise, mx = _numerics_state("rowwise"), _numerics_state("mxfp8")
    model = _models.net()
    fp8.convert_to_float8(model, recipe="mxfp8", emulate=True)
    numerics = fp8.Float8Numerics(model, dscale.StepGuard("cpu"), every=1)
    try:
        with pytest.raises(ValueError, match=r"saved by a rowwise model; .* are mxfp8"):
            numerics.load_state_dict(rowwise)
        assert numerics.num_samples == 0  # nothing changed
        numerics.load_state_dict(mx)
        assert numerics.num_samples == 1
    finally:
        numerics.close()


def test_a_batch_mxfp8_cannot_train_on_is_refused_in_forward_naming_the_layer():
    """Before: 35 tokens (5 x 7) ran the forward and failed in backward with torchao's
    AssertionError about a transposed shape. Now a ValueError in forward names the layer and
    the fixes. Oracles: torchao's MXFP8Linear alone fails in backward on the same batch (so the
    refusal is needed); without grad, and with grad_weight in high precision, the batch runs
    and gives torchao's output bit for bit."""
    from tests.fp8 import _mx_ranks

    x = torch.randn(5, 7, 32)
    ours, theirs = nn.Sequential(nn.Linear(32, 32)), nn.Sequential(nn.Linear(32, 32))
    theirs.load_state_dict(ours.state_dict())
    fp8.convert_to_float8(ours, recipe="mxfp8", emulate=True)
    _mx_ranks.torchao_mxfp8(theirs, "mxfp8", names=("0",))
    with pytest.raises(AssertionError, match="divisible by block_size 32"):
        theirs(x).sum().backward()
    with pytest.raises(ValueError, match=r"^0: MXFP8 .*\(5, 7\) = 35\) divisible by 32"):
        ours(x)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
    hp = nn.Sequential(nn.Linear(32, 32))
    fp8.convert_to_float8(hp, recipe="mxfp8_wgrad_with_hp", emulate=True)
    hp(x).sum().backward()
    assert hp[0].weight.grad is not None


def test_ranks_that_converted_otherwise_are_refused_on_every_rank_naming_each_ranks_recipe():
    """2 ranks, Float8Numerics on rank 0's MXFP8 model and rank 1's other one. Before: rank 1
    on tensorwise got "one recipe per model ... convert every layer with one recipe" (each rank
    did), and rank 1 on mxfp8_wgrad_with_hp was not refused at all (the ranks would train
    different GEMMs, silently). Now a LayoutMismatchError on both ranks, the same message,
    naming each rank's recipe or the differing layers (a layer kept on rank 1 as before)."""
    from tests.fp8 import _mx_spawn

    out = {rank: r["mismatch"] for rank, r in _mx_spawn.results().items()}
    for key in ("tensorwise", "wgrad", "kept"):
        assert out[0][key] is not None and out[0][key] == out[1][key], key
        assert out[0][key][0] == "LayoutMismatchError", key
    assert "rank 0: mxfp8; rank 1: tensorwise" in out[0]["tensorwise"][1]
    assert "wgrad_with_hp=True" in out[0]["wgrad"][1]
    assert "wgrad_with_hp=False" in out[0]["wgrad"][1]
    assert "rank 0: 4 layers, only here: ['blocks.0.fc1 (32->64)']" in out[0]["kept"][1]


def _resumable_run(directory, steps: int, stop: int | None) -> dict:
    """An MXFP8 model under a StepGuard with Float8Numerics (every 2), checkpointed by
    dscale.checkpoint after ``stop`` steps and resumed into fresh objects there."""
    from dscale.checkpoint import CheckpointManager

    def build():
        model = _models.net()
        fp8.convert_to_float8(model, recipe="mxfp8", emulate=True)
        guard = dscale.StepGuard("cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        return model, opt, guard, fp8.Float8Numerics(model, guard, every=2)

    model, opt, guard, numerics = build()
    ckpt = CheckpointManager(directory)
    losses, snapshots = [], []
    for step in range(steps):
        if step == stop:
            ckpt.save(step, model=model, optimizer=opt, scaler=guard)
            numerics.close()
            model, opt, guard, numerics = build()
            assert ckpt.resume("auto", model=model, optimizer=opt, scaler=guard) == step
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _models.loss_of(model, *_models.batch(step, size=2))
        guard.scale(loss).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
        losses.append(loss.item())
        snapshots.append(numerics.snapshot())
    state = numerics.state_dict()
    numerics.close()
    return {"losses": losses, "snapshots": snapshots, "state": state, "model": model}


def test_an_mxfp8_run_with_numerics_resumed_by_dscale_checkpoint_equals_the_uninterrupted(
    tmp_path,
):
    """Oracle: the uninterrupted run. Stopped after 1 step (between samples at 0 and 2) and
    resumed from a dscale.checkpoint into fresh objects: losses, parameters, every snapshot
    (after step 1, the one loaded with the numerics' state) and the final numerics state (with
    the MXFP8 fields and recipe) bitwise equal. (It held on f43a's branch: no finding.)"""
    whole = _resumable_run(tmp_path / "whole", 3, None)
    resumed = _resumable_run(tmp_path / "resumed", 3, 1)
    assert resumed["losses"] == whole["losses"]
    assert resumed["snapshots"] == whole["snapshots"]
    assert "blocks_clamped" in whole["snapshots"][2]["blocks.0.fc1/input"]
    assert whole["snapshots"][2] != whole["snapshots"][1] == whole["snapshots"][0]
    for key, value in whole["state"].items():
        if key == "layers":
            assert all(torch.equal(value[n], resumed["state"]["layers"][n]) for n in value)
        else:
            assert torch.equal(value, resumed["state"][key]), key
    for (name, a), b in zip(
        whole["model"].state_dict().items(), resumed["model"].state_dict().values()
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("recipe", ["mxfp8", "rowwise"])
def test_the_snapshot_scale_is_torchaos_scale_next_to_a_power_of_two(recipe):
    """The weight's largest element one float32 step above 448 x 2^-10. Before: the snapshot's
    ``scale`` came from the exact log2 (MXFP8 2^9, rowwise 2^9), torchao's cast used float32's
    (2^10: the element saturates by a hair). Oracle: torchao's own scale of that block (to_mx's
    E8M0 exponent) or row (tensor_to_scale, axiswise, power of two)."""
    import math

    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    model = nn.Sequential(nn.Linear(32, 32))
    with torch.no_grad():
        model[0].weight.mul_(1e-3)
        model[0].weight[3, 5] = torch.tensor(448 * 2.0**-10).nextafter(torch.tensor(math.inf))
    weight = model[0].weight.detach().clone()
    fp8.convert_to_float8(model, recipe=recipe, emulate=True)  # type: ignore[arg-type]
    guard = dscale.StepGuard("cpu")
    numerics = fp8.Float8Numerics(model, guard, every=1)
    try:
        guard.scale(model(torch.randn(32, 32)).square().mean()).backward()
        guard.step(torch.optim.SGD(model.parameters(), lr=0.0))
        guard.update()
        scale = numerics.snapshot()["0/weight"]["scale"]
    finally:
        numerics.close()
    if recipe == "mxfp8":
        exponent, _ = to_mx(weight, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
        want = 2.0 ** (127 - int(exponent.view(torch.uint8)[3, 0]))
    else:
        scales = tensor_to_scale(
            weight, torch.float8_e4m3fn, None, False, ScalingGranularity.AXISWISE, -1, True
        )
        want = float(scales[3])
    assert scale == want == 2.0**10


def test_the_launcher_refuses_an_mxfp8_job_whose_batches_mxfp8_cannot_train_on():
    """Before: data.batch_size=3 data.seq_len=10 (30 tokens) with fp8.recipe=mxfp8 passed the
    checks, and every worker failed at its first backward. Now a ConfigError before any worker
    naming the keys; the wgrad variant (grad_weight in high precision) takes the same job."""
    from launch.validate import ConfigError, validate
    from tests.fp8.test_mxfp8_launch import _job

    odd = ("trainer.precision=fp8", "data.batch_size=3", "data.seq_len=10")
    with pytest.raises(ConfigError, match=r"data.batch_size x data.seq_len = 3 x 10 = 30"):
        validate(_job(*odd, "fp8.recipe=mxfp8"))
    validate(_job(*odd, "fp8.recipe=mxfp8_wgrad_with_hp"))
    validate(
        _job("trainer.precision=fp8", "data.batch_size=3", "data.seq_len=32", "fp8.recipe=mxfp8")
    )


def test_mxfp8_one_non_finite_element_skips_and_frozen_and_late_params_train_as_in_bf16():
    """Review r43d: one NaN or inf in one 32-block (of the input, or of a weight) skips the step
    with every parameter unchanged, as the bf16 model's non-finite grads would; a frozen weight
    keeps grad None and a parameter added to the optimizer late trains, each grad within
    MXFP8's error of the bf16 model's; 40 tokens (not a multiple of 32) train under
    mxfp8_wgrad_with_hp."""

    def base() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))

    for bad in (float("nan"), float("inf")):
        for where in ("input", "weight"):
            model, bf16 = base(), base()
            fp8.convert_to_float8(model, recipe="mxfp8", emulate=True)
            x = torch.randn(32, 64)
            for m in (model, bf16):
                if where == "weight":
                    with torch.no_grad():
                        m[2].weight[1, 7] = bad
            if where == "input":
                x[3, 5] = bad
            bf16(x).square().mean().backward()
            assert not all(p.grad.isfinite().all() for p in bf16.parameters())  # the oracle
            guard = dscale.StepGuard("cpu")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            before = [p.detach().clone() for p in model.parameters()]
            guard.scale(model(x).square().mean()).backward()
            guard.step(opt)
            guard.update()
            assert not guard.step_applied(opt), (bad, where)
            after = [p.detach() for p in model.parameters()]
            assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(before, after))
    for recipe, tokens in (("mxfp8", 32), ("mxfp8_wgrad_with_hp", 40)):
        model, bf16 = base(), base()
        fp8.convert_to_float8(model, recipe=recipe, emulate=True)
        for m in (model, bf16):
            m[0].weight.requires_grad_(False)
        opt = torch.optim.SGD([model[0].bias, model[2].weight], lr=0.1)
        opt.add_param_group({"params": [model[2].bias]})  # late
        x = torch.randn(tokens, 64)
        guard = dscale.StepGuard("cpu")
        guard.scale(model(x).square().mean()).backward()
        bf16(x).square().mean().backward()
        assert model[0].weight.grad is None and bf16[0].weight.grad is None
        for (name, p), q in zip(model.named_parameters(), bf16.parameters()):
            if q.grad is not None:
                assert ((p.grad - q.grad).norm() / q.grad.norm()) < 0.25, (recipe, name)
        before = model[2].bias.detach().clone()
        guard.step(opt)
        guard.update()
        assert guard.step_applied(opt) and not torch.equal(before, model[2].bias)


def test_an_eval_mode_forward_with_grad_enabled_runs_any_batch_as_torchao_alone():
    """Review r43d: a validation forward in eval mode without no_grad (35 tokens) was refused
    with the training ValueError, where torchao's MXFP8Linear alone runs it; now it runs and
    gives torchao's output bit for bit. In train mode it is still refused."""
    from tests.fp8 import _mx_ranks

    x = torch.randn(5, 7, 32)
    ours, theirs = nn.Sequential(nn.Linear(32, 32)), nn.Sequential(nn.Linear(32, 32))
    theirs.load_state_dict(ours.state_dict())
    fp8.convert_to_float8(ours, recipe="mxfp8", emulate=True)
    _mx_ranks.torchao_mxfp8(theirs, "mxfp8", names=("0",))
    ours.eval()
    theirs.eval()
    assert torch.equal(ours(x), theirs(x))
    ours.train()
    with pytest.raises(ValueError, match="divisible by 32"):
        ours(x)
