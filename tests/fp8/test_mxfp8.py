"""convert_to_float8(recipe="mxfp8"): torchao's MXFP8 training in dscale's one conversion call.

Oracles: torchao's own ``MXFP8Linear`` put in by hand on the same model (losses bit for bit, on
one process and on 2 ranks under DDP and FSDP2 with a bf16 all-gather), and the bf16 model
itself (every parameter's grad within MXFP8's error of its grad; torchao's config route, which
leaves the biases' grads None, fails that same check).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from dscale.fp8 import convert_to_float8
from tests.fp8 import _models, _mx_ranks, _mx_spawn

RECIPES = ["mxfp8", "mxfp8_wgrad_with_hp"]
#: Largest relative error (norm of the difference over the norm of the bf16 grad) a parameter's
#: grad may have against the bf16 model's. E4M3 keeps 3 mantissa bits (a cast's relative error
#: is about 0.027 on Gaussian data); through the model's chained GEMMs it measured 0.12 at most
#: (a LayerNorm bias) for dscale's conversion here. A grad that is None or unrelated fails.
GRAD_TOLERANCE = 0.25


def _mx_names(model: nn.Module) -> list[str]:
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    return sorted(n for n, m in model.named_modules() if isinstance(m, MXFP8Linear))


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    tokens, target = _models.batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _models.loss_of(model, tokens, target)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _off_grads(model: nn.Module, reference: dict[str, torch.Tensor | None]) -> dict[str, str]:
    """Parameters whose grad is missing or further than GRAD_TOLERANCE from the reference's."""
    bad = {}
    for name, grad in _grads(model).items():
        ref = reference[name]
        assert ref is not None, name
        if grad is None:
            bad[name] = "None"
            continue
        err = ((grad.float() - ref.float()).norm() / ref.float().norm()).item()
        if not err <= GRAD_TOLERANCE:
            bad[name] = f"{err:.3f}"
    return bad


@pytest.mark.parametrize("recipe", RECIPES)
def test_mxfp8_converts_linears_with_dims_divisible_by_32_and_logs_the_rest(recipe, caplog):
    """Block linears become MXFP8Linear (emulated, RCEIL; the recipe's wgrad); 32->10 and
    dims divisible by 16 but not 32 stay, each named with why."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    model = _models.net()
    model.extra = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 64))  # 48: 16 | 48, 32 does not
    with caplog.at_level(logging.INFO, logger="dscale.fp8._convert"):
        conv = convert_to_float8(model, recipe=recipe, emulate=True)
    assert conv.recipe == recipe and not conv.float8_all_gather
    assert list(conv.converted) == list(_mx_ranks.LINEARS) == _mx_names(model)
    assert set(conv.left) == {"head", "extra.0", "extra.1"}
    assert "divisible by 32" in conv.left["extra.0"]
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "extra.0 stays in high precision" in logged and "head stays" in logged
    fc1 = model.blocks[0].fc1
    assert fc1.kernel_preference == KernelPreference.EMULATED
    assert fc1.scale_calculation_mode == ScaleCalculationMode.RCEIL
    assert fc1.wgrad_with_hp == (recipe == "mxfp8_wgrad_with_hp")
    # The parameters are the model's own (an optimizer made before still holds them).
    tensorwise = _models.net()
    assert torch.equal(fc1.weight, tensorwise.blocks[0].fc1.weight)
    assert torch.equal(fc1.bias, tensorwise.blocks[0].fc1.bias)
    # Under the tensorwise recipe, the 48-wide layers are taken (16 divides 48).
    other = _models.net()
    other.extra = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 64))
    assert "extra.0" in convert_to_float8(other, emulate=True).converted


def test_mxfp8_refuses_float8_all_gather_naming_the_fix():
    with pytest.raises(ValueError, match="float8_all_gather=True needs recipe='tensorwise'"):
        convert_to_float8(_models.net(), recipe="mxfp8", float8_all_gather=True)


def test_every_parameter_trains_within_mxfp8_error_of_bf16_and_the_config_route_fails_it():
    """dscale's conversion: every grad present and within MXFP8's error of the bf16 model's.
    Negative control: torchao's config route (quantize_ with MXFP8TrainingOpConfig) on the same
    linears leaves each bias's grad None, and the same check names those biases."""
    from torchao.prototype.moe_training.config import (
        MXFP8TrainingOpConfig,
        MXFP8TrainingRecipe,
    )
    from torchao.quantization import quantize_

    bf16 = _models.net()
    reference = _grads(bf16)
    for recipe in RECIPES:
        model = copy.deepcopy(bf16)
        convert_to_float8(model, recipe=recipe, emulate=True)  # type: ignore[arg-type]
        assert _off_grads(model, reference) == {}, recipe
        assert _off_grads(copy.deepcopy(bf16), reference) == {}  # bf16 itself passes
    config_route = copy.deepcopy(bf16)
    quantize_(
        config_route,
        MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL),
        filter_fn=lambda module, fqn: fqn in _mx_ranks.LINEARS,
    )
    off = _off_grads(config_route, reference)
    assert {n for n, why in off.items() if why == "None"} == {
        f"{name}.bias" for name in _mx_ranks.LINEARS
    }


@pytest.mark.parametrize("recipe", RECIPES)
def test_mxfp8_losses_equal_torchaos_own_mxfp8linear_bitwise_under_step_guard(recipe):
    """dscale's conversion + StepGuard trains bit for bit as torchao's MXFP8Linear, plain loop."""
    ours = _mx_ranks.train(0, "dscale", recipe, steps=3)
    theirs = _mx_ranks.train(0, "torchao", recipe, steps=3)
    assert ours["losses"] == theirs["losses"]
    assert ours["skipped"][-1] == 0
    for name, value in theirs["params"].items():
        assert torch.equal(ours["params"][name], value), name
    # The runs differ from bf16's (MXFP8 is on): a conversion that did nothing would fail here.
    plain = _models.net()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = _models.loss_of(plain, *_models.batch(0)).item()
    assert ours["losses"][0] != first


def test_mxfp8_trains_like_torchao_alone_on_2_ranks_ddp_and_fsdp2_and_skips_rank_1s_inf():
    out = {rank: r["train"] for rank, r in _mx_spawn.results().items()}
    assert set(out[0]) == {"ddp/mxfp8", "fsdp2/mxfp8_wgrad_with_hp", "inf"}
    for key in ("ddp/mxfp8", "fsdp2/mxfp8_wgrad_with_hp"):
        for rank in (0, 1):
            runs = out[rank][key]
            assert runs["dscale"]["losses"] == runs["torchao"]["losses"], (key, rank)
            for name, value in runs["torchao"]["params"].items():
                assert torch.equal(runs["dscale"]["params"][name], value), (key, rank, name)
        # Ranks hold the same weights after training (their batches differ).
        assert out[0][key]["dscale"]["losses"] != out[1][key]["dscale"]["losses"]
        for name, value in out[0][key]["dscale"]["params"].items():
            assert torch.equal(out[1][key]["dscale"]["params"][name], value), (key, name)
    # An inf in rank 1's grad at step 1 skips that step on both ranks (agreed), not the others.
    assert out[0]["inf"]["skipped"] == out[1]["inf"]["skipped"] == [0, 1, 1]
