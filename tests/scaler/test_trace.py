"""The 20-step scale trace from the tutorial (../shared/seeds/002_*.txt) is reproduced exactly.

Setup there: init_scale 2**15, growth_interval 5, an overflow injected at step 10. The scale after
each step doubles at steps 4 and 9 (five clean steps each), halves at step 10, and doubles again at
step 15, five clean steps after the overflow.
"""

from __future__ import annotations

import torch

import dscale

EXPECTED_SCALE_AFTER_STEP = (
    [32768.0] * 4 + [65536.0] * 5 + [131072.0] + [65536.0] * 5 + [131072.0] * 5
)
EXPECTED_CLEAN_AFTER_STEP = [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4]


def test_twenty_step_trace_matches_the_tutorial_exactly() -> None:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([weight], lr=0.1)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**15, growth_interval=5)
    scales, clean, applied = [], [], []
    for step in range(20):
        opt.zero_grad()
        g = torch.randn(4) * 1e-4
        if step == 10:
            g *= 1e6  # the deliberate spike of the tutorial
        loss = (weight * g.half().float()).sum()
        scaler.scale(loss).backward()
        weight.grad = weight.grad.half().float()  # what an fp16 grad would hold
        if step == 10:
            weight.grad[0] = float("inf")  # the spike overflows fp16 at this scale
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        clean.append(scaler.snapshot()["growth_tracker"])
        applied.append(scaler.step_applied(opt))
    assert scales == EXPECTED_SCALE_AFTER_STEP
    assert clean == EXPECTED_CLEAN_AFTER_STEP
    assert applied == [step != 10 for step in range(20)]


def test_trace_matches_torch_gradscaler_step_for_step() -> None:
    ours = dscale.GradScaler("cpu", init_scale=2.0**15, growth_interval=5)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**15, growth_interval=5)
    pattern = [0, 0, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0] * 3
    for overflow in pattern:
        for scaler in (ours, theirs):
            w = torch.nn.Parameter(torch.ones(3))
            opt = torch.optim.SGD([w], lr=0.0)
            scaler.scale(w.sum()).backward()
            if overflow:
                w.grad[1] = float("nan")
            scaler.step(opt)
            scaler.update()
        assert ours.get_scale() == theirs.get_scale()
        assert ours.state_dict()["_growth_tracker"] == theirs.state_dict()["_growth_tracker"]
