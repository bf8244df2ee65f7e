"""The placements' per-step host work (review r42a): an optimizer with no DTensor param costs a
step nothing per param here; ``optimizer_grads`` already visits each grad once."""

from __future__ import annotations

from typing import Any

import torch

import dscale
from dscale.scaler._program import placements


class _Counted(list):  # type: ignore[type-arg]
    """A param list that counts how often it is walked."""

    walks = 0

    def __iter__(self) -> Any:
        type(self).walks += 1
        return super().__iter__()


def _optimizer(count: int) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(count)]
    for p in params:
        p.grad = torch.ones(2)
    opt = torch.optim.SGD(params, lr=0.1)
    opt.param_groups[0]["params"] = _Counted(opt.param_groups[0]["params"])
    return opt


def test_plain_tensor_params_are_not_walked_per_step_by_the_placements() -> None:
    """200 plain params: the first step looks at them once (no DTensor), later steps not at all
    (p42a's feb2337 walked every param list and built an id key per step: about 40 us at 200
    params, 60% on top of optimizer_grads' own pass); a group added is looked at again."""
    opt = _optimizer(200)
    _Counted.walks = 0
    for _ in range(3):
        assert placements.sum_partial_grads(opt) is None
    assert _Counted.walks == 1
    extra = torch.nn.Parameter(torch.ones(2))
    extra.grad = torch.ones(2)
    opt.add_param_group({"params": [extra]})
    _Counted.walks = 0
    assert placements.sum_partial_grads(opt) is None
    assert placements.sum_partial_grads(opt) is None
    assert _Counted.walks == 1  # the first group once more, after the add; then not at all


def test_a_step_on_plain_params_still_skips_an_overflow_after_the_cache() -> None:
    """The shortcut changes no decision: dscale's step on plain params skips the inf step and
    takes the others, as torch's scaler does on the same grads."""
    ours, theirs = _optimizer(3), _optimizer(3)
    scalers = dscale.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for step in range(3):
        for opt, scaler in zip((ours, theirs), scalers, strict=True):
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = torch.full((2,), float("inf") if step == 1 else 1.0)
            scaler.scale(torch.ones(()))
            scaler.step(opt)
            scaler.update()
    for a, b in zip(ours.param_groups[0]["params"], theirs.param_groups[0]["params"], strict=True):
        assert torch.equal(a, b)
    assert scalers[0].get_scale() == scalers[1].get_scale()
