"""apex-style functions: flat and per-param masters train identically, and like FP16Optimizer."""

from __future__ import annotations

import pytest
import torch

from dscale import (
    FP16Optimizer,
    master_params_to_model_params,
    model_grads_to_master_grads,
    prep_param_lists,
)

from ._setup import flat, loss_of, mlp

SCALE = 128.0
STEPS = 8


def _train_by_hand(flat_master: bool) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """apex's "Real Examples" manual loop with a static scale."""
    model = mlp()
    model_params, master_params = prep_param_lists(model, flat_master=flat_master)
    opt = torch.optim.SGD(master_params, lr=0.05, momentum=0.9)
    for step in range(STEPS):
        model.zero_grad()
        (loss_of(model, step) * SCALE).backward()
        model_grads_to_master_grads(model_params, master_params, flat_master=flat_master)
        for master in master_params:
            master.grad.mul_(1.0 / SCALE)
        opt.step()
        master_params_to_model_params(model_params, master_params, flat_master=flat_master)
    return model, master_params


def test_flat_and_per_param_masters_and_fp16_optimizer_give_the_same_weights() -> None:
    flat_model, flat_masters = _train_by_hand(flat_master=True)
    split_model, split_masters = _train_by_hand(flat_master=False)

    model = mlp()
    opt = FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), SCALE)
    for step in range(STEPS):
        opt.zero_grad()
        opt.backward(loss_of(model, step))
        opt.step()

    assert len(flat_masters) == 1
    assert flat_masters[0].dtype == torch.float32
    assert flat_masters[0].is_contiguous()
    assert torch.equal(flat_masters[0].detach(), flat(split_masters))
    assert torch.equal(flat(list(flat_model.parameters())), flat(list(split_model.parameters())))
    assert torch.equal(flat(list(model.parameters())), flat(list(split_model.parameters())))
    start = flat(list(mlp().parameters()))
    assert not torch.equal(flat(list(model.parameters())), start)


def test_flat_master_names_the_params_whose_dtype_differs() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).half()
    model[1].float()  # fp32 norm, a common mixed model
    with pytest.raises(ValueError, match=r"1\.weight, 1\.bias") as info:
        prep_param_lists(model, flat_master=True)
    assert "torch.float32" in str(info.value)
    assert "flat_master=False" in str(info.value)
    # Per-param masters take the mixed model.
    _, masters = prep_param_lists(model)
    assert [m.dtype for m in masters] == [torch.float32] * 4


def test_a_param_without_grad_gives_its_master_no_grad_or_a_zero_flat_grad() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).half()
    model[0].weight.grad = torch.full_like(model[0].weight, 2.0)
    params, masters = prep_param_lists(model)
    model_grads_to_master_grads(params, masters)
    assert torch.equal(masters[0].grad, torch.full((4, 4), 2.0))
    assert [m.grad for m in masters[1:]] == [None, None, None]

    params, (flat_master,) = prep_param_lists(model, flat_master=True)
    flat_master.grad.fill_(7.0)
    model_grads_to_master_grads(params, [flat_master], flat_master=True)
    assert torch.equal(flat_master.grad[:16], torch.full((16,), 2.0))
    assert torch.equal(flat_master.grad[16:], torch.zeros(24))


def test_master_params_to_model_params_rounds_masters_into_the_fp16_model() -> None:
    model = torch.nn.Linear(3, 2, bias=False).half()
    params, masters = prep_param_lists(model)
    with torch.no_grad():
        masters[0].fill_(1.0 + 2.0**-12)  # between two fp16 values: rounds to 1.0
        masters[0][0, 0] = 1.5
    master_params_to_model_params(params, masters)
    assert model.weight.dtype == torch.float16
    assert model.weight[0, 0].item() == 1.5
    assert model.weight[1, 2].item() == 1.0


def test_mismatched_lists_are_rejected_with_the_fix() -> None:
    model = mlp()
    params, masters = prep_param_lists(model)
    with pytest.raises(ValueError, match="pass the two lists prep_param_lists returned"):
        master_params_to_model_params(params, masters[:-1])
