"""dscale.checkpoint keeps a StepGuard's counters and spike window; a resumed run decides alike."""

from __future__ import annotations

import torch

import dscale
from dscale.checkpoint import CheckpointManager
from tests.checkpoint._helpers import make_model

GATE = {"spike_signals": ("loss", "grad_norm"), "spike_window": 8, "spike_warmup": 4}


def _steps(model, opt, guard, start: int, stop: int) -> list[bool]:
    applied = []
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(step)
        torch.manual_seed(step)  # dropout
        loss = model(torch.randn(6, 4, generator=gen)).pow(2).mean()
        if step in (3, 11):
            loss = loss * (float("inf") if step == 3 else 1000.0)  # an inf, then a spike
        guard.scale(loss).backward()
        guard.step(opt)
        applied.append(guard.step_applied())
        guard.update()
        opt.zero_grad()
    return applied


def test_a_step_guard_window_round_trips_through_a_checkpoint(tmp_path) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = dscale.StepGuard("cpu", **GATE)
    _steps(model, opt, guard, 0, 8)
    CheckpointManager(tmp_path).save(8, model=model, optimizer=opt, scaler=guard)
    expected = guard.state_dict()

    model2 = make_model(seed=5)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    guard2 = dscale.StepGuard("cpu", **GATE)
    assert (
        CheckpointManager(tmp_path).resume("auto", model=model2, optimizer=opt2, scaler=guard2) == 8
    )
    got = guard2.state_dict()
    assert torch.equal(got.pop("spike_window_values"), expected.pop("spike_window_values"))
    assert got == expected
    assert expected["num_skipped_steps"] == 1 and expected["spike_window_entered"] == 7
    # Both go on alike: the spike at step 11 is caught from the restored window.
    assert _steps(model, opt, guard, 8, 14) == _steps(model2, opt2, guard2, 8, 14)
    assert guard2.snapshot()["spike_skipped_steps"] == 1
