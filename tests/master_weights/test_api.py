"""FP16Optimizer's apex API: param groups, closures, several losses, loss scale, errors."""

from __future__ import annotations

import logging

import pytest
import torch

from dscale import FP16Optimizer

from ._setup import flat, loss_of, masters, mlp, train_step


def _mixed_model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    model[0].half()
    model[2].half()
    return model


def test_fp16_params_get_fp32_masters_and_fp32_params_are_used_as_they_are() -> None:
    model = _mixed_model()
    inner = torch.optim.SGD(
        [
            {"params": list(model[0].parameters()) + list(model[1].parameters()), "lr": 0.1},
            {"params": list(model[2].parameters()), "lr": 0.01, "momentum": 0.9},
        ],
        lr=0.5,
    )
    opt = FP16Optimizer(inner)

    assert opt.optimizer is inner
    assert [g["lr"] for g in inner.param_groups] == [0.1, 0.01]
    assert inner.param_groups[1]["momentum"] == 0.9
    group0 = inner.param_groups[0]["params"]
    assert [p.dtype for p in group0] == [torch.float32] * 4
    assert group0[2] is model[1].weight and group0[3] is model[1].bias  # fp32: not copied
    assert group0[0] is not model[0].weight
    assert torch.equal(group0[0].half(), model[0].weight)
    assert opt.fp16_groups[1] == list(model[2].parameters())


def test_the_fp32_params_of_a_mixed_model_get_unscaled_grads() -> None:
    model = _mixed_model()
    opt = FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=256.0)
    x = torch.randn(16, 8).half()
    opt.backward(model[2](model[1](model[0](x).float()).half()).float().pow(2).mean())
    norm_grad = opt.inspect_master_grad_data()[0][2]
    assert norm_grad.data_ptr() == model[1].weight.grad.data_ptr()  # the param's own grad

    reference = _mixed_model()
    reference.load_state_dict(model.state_dict())
    reference[2](reference[1](reference[0](x).float()).half()).float().pow(2).mean().backward()
    torch.testing.assert_close(norm_grad, reference[1].weight.grad, rtol=1e-3, atol=1e-6)


def test_a_closure_step_with_a_static_scale_equals_backward_then_step() -> None:
    model_a, model_b = mlp(), mlp()
    opt_a = FP16Optimizer(torch.optim.SGD(model_a.parameters(), lr=0.1), static_loss_scale=64.0)
    opt_b = FP16Optimizer(torch.optim.SGD(model_b.parameters(), lr=0.1), static_loss_scale=64.0)
    for step in range(3):
        train_step(model_a, opt_a, step)

        def closure(step: int = step) -> torch.Tensor:
            opt_b.zero_grad()
            loss = loss_of(model_b, step)
            opt_b.backward(loss)
            return loss

        loss = opt_b.step(closure)
        assert isinstance(loss, torch.Tensor)
    assert torch.equal(flat(list(model_a.parameters())), flat(list(model_b.parameters())))


def test_lbfgs_sees_the_masters_rounded_into_the_model_on_every_closure_call() -> None:
    model = mlp()
    opt = FP16Optimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4))
    seen = []

    def closure() -> torch.Tensor:
        seen.append(flat(list(model.parameters())))
        opt.zero_grad()
        loss = loss_of(model, 0)
        opt.backward(loss)
        return loss

    first = loss_of(model, 0).item()
    opt.step(closure)
    assert len(seen) > 1
    assert not torch.equal(seen[0], seen[1])  # re-evaluated at the new point
    assert torch.equal(flat(list(model.parameters())), masters(opt).half().float())
    assert loss_of(model, 0).item() < first


def test_a_closure_with_a_dynamic_scale_is_refused_with_the_fix() -> None:
    model = mlp()
    opt = FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)
    with pytest.raises(ValueError, match="dynamic_loss_scale=True"):
        opt.step(lambda: loss_of(model, 0))


def test_several_losses_with_update_master_grads_false_add_up() -> None:
    model_a, model_b = mlp(), mlp()
    opt_a = FP16Optimizer(torch.optim.SGD(model_a.parameters(), lr=0.1), dynamic_loss_scale=True)
    opt_b = FP16Optimizer(torch.optim.SGD(model_b.parameters(), lr=0.1), dynamic_loss_scale=True)
    opt_a.backward(loss_of(model_a, 0) + loss_of(model_a, 1))
    opt_b.backward(loss_of(model_b, 0), update_master_grads=False)
    opt_b.backward(loss_of(model_b, 1), update_master_grads=False)
    opt_a.step()
    opt_b.step()  # updates the master grads itself
    torch.testing.assert_close(masters(opt_a), masters(opt_b), rtol=0, atol=1e-6)


def test_backward_after_the_master_grads_were_updated_is_refused() -> None:
    model = mlp()
    opt = FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)
    opt.backward(loss_of(model, 0))
    with pytest.raises(RuntimeError, match="update_master_grads=False"):
        opt.backward(loss_of(model, 1))


def test_a_new_backward_after_zero_grad_without_step_is_refused_with_a_dynamic_scale() -> None:
    model = mlp()
    opt = FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)
    opt.backward(loss_of(model, 0))
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="Call step"):
        opt.backward(loss_of(model, 1))
    opt.step()  # the way out: nothing to apply, and the next iteration works
    train_step(model, opt, 2)
    assert not opt.overflow


def test_loss_scale_can_be_read_and_set_in_both_modes() -> None:
    static = FP16Optimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), static_loss_scale=8.0)
    assert static.loss_scale == 8.0
    static.loss_scale = 32.0
    assert static.loss_scale == 32.0
    assert static.state_dict()["loss_scale"] == 32.0

    model = mlp()
    dynamic = FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)
    assert dynamic.loss_scale == 2.0**16  # GradScaler's default, before any step
    dynamic.loss_scale = 1024.0
    train_step(model, dynamic, 0)
    assert dynamic.loss_scale == 1024.0
    dynamic.loss_scale = 4.0
    assert dynamic.loss_scale == 4.0
    with pytest.raises(ValueError, match=r"loss_scale must be a finite number > 0, got -1"):
        dynamic.loss_scale = -1


def test_apex_dynamic_loss_args_map_to_grad_scaler_arguments() -> None:
    opt = FP16Optimizer(
        torch.optim.SGD(mlp().parameters(), lr=0.1),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**8, "scale_factor": 4.0, "scale_window": 50},
    )
    state = opt.state_dict()["scaler"]
    assert (state["scale"], state["growth_factor"], state["backoff_factor"]) == (256.0, 4.0, 0.25)
    assert state["growth_interval"] == 50

    own = FP16Optimizer(
        torch.optim.SGD(mlp().parameters(), lr=0.1),
        dynamic_loss_scale=True,
        dynamic_loss_args={"growth_interval": 7, "backoff_factor": 0.25, "min_scale": 2.0},
    )
    state = own.state_dict()["scaler"]
    assert (state["growth_interval"], state["backoff_factor"], state["min_scale"]) == (7, 0.25, 2.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"static_loss_scale": 0.0}, r"static_loss_scale must be a finite number > 0, got 0\.0"),
        ({"static_loss_scale": float("inf")}, "static_loss_scale must be a finite"),
        (
            {"dynamic_loss_scale": True, "dynamic_loss_args": {"scale_windw": 5}},
            r"unknown keys \['scale_windw'\]",
        ),
        (
            {
                "dynamic_loss_scale": True,
                "dynamic_loss_args": {"scale_factor": 2, "backoff_factor": 1},
            },
            "pass either scale_factor or GradScaler's names",
        ),
        (
            {
                "dynamic_loss_scale": True,
                "dynamic_loss_args": {"scale_window": 5, "growth_interval": 6},
            },
            "they are the same setting",
        ),
        (
            {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": -2.0}},
            r"dynamic_loss_args=\{'init_scale': -2\.0\}: .*init_scale",
        ),
        ({"dynamic_loss_args": {"init_scale": 8.0}}, "has no effect with dynamic_loss_scale=False"),
    ],
    ids=["zero_scale", "inf_scale", "typo", "factor_twice", "window_twice", "bad_value", "unused"],
)
def test_bad_arguments_raise_a_value_error_naming_them(kwargs: dict, message: str) -> None:
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=message):
        FP16Optimizer(inner, **kwargs)
    assert inner.param_groups[0]["params"][0] is next(model.parameters())  # left as it was


def test_existing_optimizer_state_moves_to_the_masters_in_fp32() -> None:
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_of(model, 0).backward()
    inner.step()  # momentum buffers in fp16, keyed by the fp16 params
    buffers = [inner.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    opt = FP16Optimizer(inner)
    moved = [opt.state[m]["momentum_buffer"] for m in opt.fp32_from_fp16_groups[0]]
    assert [b.dtype for b in moved] == [torch.float32] * len(buffers)
    assert torch.equal(flat(moved), flat(buffers))


def test_verbose_logs_what_was_ingested(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dscale"):
        FP16Optimizer(torch.optim.SGD(_mixed_model().parameters(), lr=0.1), verbose=True)
    assert "4 16-bit params get fp32 masters (108 elements), 2 fp32 params" in caplog.text


def test_zero_grad_clears_model_and_master_grads() -> None:
    model = mlp()
    opt = FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.backward(loss_of(model, 0))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(g is None for group in opt.inspect_master_grad_data() for g in group)
