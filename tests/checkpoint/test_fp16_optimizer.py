"""dscale.FP16Optimizer (master weights) is saved and restored as a generic Stateful."""

from __future__ import annotations

import pytest
import torch

from dscale.checkpoint import CheckpointError, CheckpointManager

master_weights = pytest.importorskip("dscale.master_weights")


def _pieces(seed: int, steps: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = model.half()
    opt = master_weights.FP16Optimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 256.0, "growth_interval": 2},
    )
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(5, 4, generator=gen).half()).float().pow(2).mean()
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
    return model, opt


def test_fp16_optimizer_masters_state_and_scale_roundtrip(tmp_path):
    model, opt = _pieces(seed=0, steps=3)
    CheckpointManager(tmp_path).save(3, model=model, optimizer=opt)

    model2, opt2 = _pieces(seed=1, steps=1)  # one step so that Adam's state exists
    assert CheckpointManager(tmp_path).resume("auto", model=model2, optimizer=opt2) == 3

    want, got = opt.state_dict(), opt2.state_dict()
    for a, b in zip(want["fp32_from_fp16"], got["fp32_from_fp16"], strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    assert want["optimizer"]["state"].keys() == got["optimizer"]["state"].keys()
    for key, state in want["optimizer"]["state"].items():
        torch.testing.assert_close(got["optimizer"]["state"][key], state, rtol=0, atol=0)
    scalar_keys = [k for k, v in want.items() if isinstance(v, int | float)]
    assert scalar_keys and all(got[k] == want[k] for k in scalar_keys)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_fp16_optimizer_without_state_is_refused_instead_of_loading_partially(tmp_path):
    model, opt = _pieces(seed=0, steps=2)
    CheckpointManager(tmp_path).save(2, model=model, optimizer=opt)
    model2, opt2 = _pieces(seed=1, steps=0)
    with pytest.raises(CheckpointError, match=r"step-2 does not match the optimizer.*initialized"):
        CheckpointManager(tmp_path).resume("auto", model=model2, optimizer=opt2)
