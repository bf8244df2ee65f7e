"""MXFP8 layers under autocast: the GEMM's operands in the autocast dtype, as nn.Linear's.

torchao 0.18's emulated ``MXFP8Linear`` dequantizes each operand to the dtype it was given, so a
bf16 activation (a high-precision linear's output under autocast) and an fp32 weight (AMP's
parameters) meet in one GEMM as different dtypes and raise. Oracles, computed here: torchao's own
``MXFP8Linear`` on the bf16 model, where every operand already is bf16 and torchao works (loss
and every grad bit for bit); torchao alone where it works on the fp32 model (without autocast,
and all-MXFP8 under autocast: bit for bit); the bf16 model itself (every grad within MXFP8's
error).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import dscale
from dscale.fp8 import convert_to_float8
from dscale.precision import PrecisionSchedule
from tests.fp8 import _mx_ranks
from tests.fp8.test_mxfp8 import GRAD_TOLERANCE

RECIPES = ["mxfp8", "mxfp8_wgrad_with_hp"]
#: The MXFP8 layers of _mixed(): "0" (48 inputs, not divisible by 32) stays nn.Linear.
MX = ("2", "4")


def _mixed(first_in: int = 48) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(first_in, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32)
    )


def _batch(first_in: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, first_in, generator=g), torch.randn(64, 32, generator=g)


def _loss_and_grads(
    model: nn.Module, *, autocast: bool = True, first_in: int = 48, guard: Any = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    x, target = _batch(first_in)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    loss = nn.functional.mse_loss(out.float(), target)
    (loss if guard is None else guard.scale(loss)).backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _torchao_alone(model: nn.Module, recipe: str, names: tuple[str, ...] = MX) -> nn.Module:
    return _mx_ranks.torchao_mxfp8(model, recipe, names)


def _io_dtypes(model: nn.Module, names: tuple[str, ...]) -> dict[str, tuple[torch.dtype, ...]]:
    """Each named layer's (input, output) dtype in one autocast forward and backward."""
    seen: dict[str, tuple[torch.dtype, ...]] = {}
    hooks = [
        model.get_submodule(n).register_forward_hook(
            lambda m, a, out, n=n: seen.__setitem__(n, (a[0].dtype, out.dtype))
        )
        for n in names
    ]
    _loss_and_grads(model)
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_left_out_linear_feeding_an_mxfp8_one_trains_under_autocast_within_mxfp8_error(recipe):
    """The fp32 model converted (layer 0 left out: 48 inputs) under bf16 autocast: each MXFP8
    layer takes and gives bf16 (autocast's dtype), and every grad is fp32 and within MXFP8's
    error of the plain model's under the same autocast. Fails on int6 (a9d1abb): torchao raises
    "expected m1 and m2 to have the same dtype, but got: c10::BFloat16 != float" in the forward
    of layer "2" (its bf16 input against its fp32 weight)."""
    plain = _mixed()
    model = copy.deepcopy(plain)
    conv = convert_to_float8(model, recipe=recipe, emulate=True)
    assert tuple(conv.converted) == MX and "0" in conv.left
    assert _io_dtypes(model, MX) == dict.fromkeys(MX, (torch.bfloat16, torch.bfloat16))
    _, grads = _loss_and_grads(model)
    _, reference = _loss_and_grads(copy.deepcopy(plain))
    off = {n: ((g - reference[n]).norm() / reference[n].norm()).item() for n, g in grads.items()}
    assert all(g.dtype == torch.float32 for g in grads.values())
    assert max(off.values()) <= GRAD_TOLERANCE, off
    assert off["2.weight"] > 0  # MXFP8 is on: a layer that ran nn.Linear's GEMM would be 0


def test_where_torchao_alone_works_the_losses_and_grads_equal_it_bitwise():
    """1. The mixed fp32 model under bf16 autocast against torchao's own MXFP8Linear on the
    bf16 model (every operand bf16, where torchao works): loss and every grad bit for bit (ours
    fp32). Fails on int6 (a9d1abb): torchao's dtype RuntimeError in the forward of layer "2".
    2. Without autocast (fp32 throughout), and all-MXFP8 under autocast (fp32 operands, which
    torchao's emulation keeps in fp32): three AdamW steps' losses equal torchao alone's."""
    for recipe in RECIPES:
        plain = _mixed()
        model = copy.deepcopy(plain)
        convert_to_float8(model, recipe=recipe, emulate=True)  # type: ignore[arg-type]
        loss, grads = _loss_and_grads(model)
        oracle = _torchao_alone(copy.deepcopy(plain), recipe).to(torch.bfloat16)
        want_loss, want = _loss_and_grads(oracle)
        assert torch.equal(loss, want_loss), recipe
        for name, grad in grads.items():
            assert torch.equal(grad, want[name].float()), (recipe, name)

    def losses(model: nn.Module, *, autocast: bool, first_in: int) -> list[torch.Tensor]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = []
        for _ in range(3):
            loss, _ = _loss_and_grads(model, autocast=autocast, first_in=first_in)
            opt.step()
            out.append(loss)
        return out

    for autocast, first_in, names in ((False, 48, MX), (True, 32, ("0", *MX))):
        ours = _mixed(first_in)
        convert_to_float8(ours, recipe="mxfp8", emulate=True)
        theirs = _torchao_alone(_mixed(first_in), "mxfp8", names)
        got = losses(ours, autocast=autocast, first_in=first_in)
        want = losses(theirs, autocast=autocast, first_in=first_in)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (autocast, got, want)


def test_the_schedules_bf16_then_mxfp8_map_trains_under_autocast():
    """PrecisionSchedule {"0": "bf16", "2": "mxfp8"} on an fp32 model under bf16 autocast: loss
    and grads equal torchao's MXFP8Linear on the bf16 model bit for bit, and a guarded step
    applies. Fails on int6 (a9d1abb): torchao's dtype RuntimeError in the forward of "2"."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    model = copy.deepcopy(plain)
    guard = dscale.StepGuard("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    PrecisionSchedule(model, guard, initial={"0": "bf16", "2": "mxfp8"}, emulate=True)
    before = model[2].weight.detach().clone()
    loss, grads = _loss_and_grads(model, first_in=32, guard=guard)
    oracle = _torchao_alone(copy.deepcopy(plain), "mxfp8", ("2",)).to(torch.bfloat16)
    want_loss, want = _loss_and_grads(oracle, first_in=32)
    assert torch.equal(loss, want_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, want[name].float()), name
    guard.step(opt)
    guard.update()
    assert not torch.equal(model[2].weight, before)
