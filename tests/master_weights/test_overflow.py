"""An overflowing step is skipped: masters, model and optimizer state stay, the scale backs off."""

from __future__ import annotations

import torch

from dscale import FP16Optimizer

from ._setup import flat, loss_of, masters, mlp, train_step


def _momenta(opt: FP16Optimizer) -> torch.Tensor:
    return flat([s["momentum_buffer"] for s in opt.state.values()])


def test_injected_inf_skips_the_step_and_halves_the_scale() -> None:
    model = mlp()
    opt = FP16Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**10},
    )
    for step in range(3):
        train_step(model, opt, step)
        assert not opt.overflow

    before = (masters(opt), flat(list(model.parameters())), _momenta(opt), opt.loss_scale)
    opt.zero_grad()
    opt.backward(loss_of(model, 3), update_master_grads=False)
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    opt.update_master_grads()
    assert opt.clip_master_grads(1.0) == -1.0
    opt.step()

    assert opt.overflow
    assert torch.equal(masters(opt), before[0])
    assert torch.equal(flat(list(model.parameters())), before[1])
    assert torch.equal(_momenta(opt), before[2])
    assert opt.loss_scale == before[3] / 2

    train_step(model, opt, 4)  # the next clean step is applied again
    assert not opt.overflow
    assert not torch.equal(flat(list(model.parameters())), before[1])


def test_a_scale_too_large_for_fp16_grads_backs_off_until_steps_apply() -> None:
    model = mlp()
    start = flat(list(model.parameters()))
    # apex's old default init_scale of 2**32 overflows these fp16 grads; scale_factor 4 halves
    # twice per back-off.
    opt = FP16Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**32, "scale_factor": 4.0},
    )
    skipped = []
    for step in range(12):
        train_step(model, opt, step)
        skipped.append(opt.overflow)
        if skipped[0] and not skipped[-1]:
            break
    first_applied = skipped.index(False)
    assert first_applied >= 1
    assert all(skipped[:first_applied])
    assert opt.loss_scale == 2.0**32 / 4**first_applied
    assert not torch.equal(flat(list(model.parameters())), start)
    assert flat(list(model.parameters())).isfinite().all()


def test_clip_master_grads_returns_the_norm_of_the_unscaled_grads_and_clips_them() -> None:
    model = mlp()
    opt = FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=512.0)
    opt.backward(loss_of(model, 0))
    grads = [g for group in opt.inspect_master_grad_data() for g in group]
    expected = torch.linalg.vector_norm(flat(grads)).item()

    # The same model with no scaling at all gives the same grads (512 is a power of two).
    plain = mlp()
    loss_of(plain, 0).backward()
    plain_norm = torch.linalg.vector_norm(flat([p.grad for p in plain.parameters()])).item()
    assert abs(expected - plain_norm) < 1e-3 * plain_norm

    assert abs(opt.clip_master_grads(expected / 4) - expected) < 1e-5 * expected
    clipped = flat([g for group in opt.inspect_master_grad_data() for g in group])
    assert abs(torch.linalg.vector_norm(clipped).item() - expected / 4) < 1e-3 * expected


def test_clip_master_grads_takes_apex_inf_norm_spelling() -> None:
    model = mlp()
    opt = FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=8.0)
    opt.backward(loss_of(model, 0))
    largest = flat([g for group in opt.inspect_master_grad_data() for g in group]).abs().max()
    assert opt.clip_master_grads(1e6, norm_type="inf") == largest.item()
