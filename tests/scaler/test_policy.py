"""Beyond torch: min/max clamping, both kinds of hysteresis, and a scale stuck at its minimum."""

from __future__ import annotations

import logging

import pytest
import torch

import dscale
from tests.scaler._setup import decide_on_device

pytestmark = pytest.mark.filterwarnings("ignore:dscale.GradScaler.*:UserWarning")


def _drive(scaler, pattern):
    """One optimizer step per entry: 1 = overflow, 0 = clean; returns the scale after each."""
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.0)
    scales = []
    for overflow in pattern:
        opt.zero_grad()
        scaler.scale(w.sum()).backward()
        if overflow:
            w.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_min_scale_stops_the_underflow_to_zero_that_torch_allows() -> None:
    theirs = torch.amp.GradScaler("cpu", init_scale=1.0)
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.0)
    for _ in range(200):
        theirs.scale(w.sum()).backward()
        w.grad[0] = float("inf")
        theirs.step(opt)
        theirs.update()
    assert theirs.get_scale() == 0.0  # torch's scale collapsed to zero
    ours = dscale.GradScaler("cpu", init_scale=4.0, min_scale=1.0, stuck_patience=10_000)
    assert _drive(ours, [1, 1, 1, 1]) == [2.0, 1.0, 1.0, 1.0]


def test_max_scale_caps_growth() -> None:
    scaler = dscale.GradScaler("cpu", init_scale=4.0, growth_interval=1, max_scale=16.0)
    assert _drive(scaler, [0, 0, 0, 0]) == [8.0, 16.0, 16.0, 16.0]
    assert scaler.snapshot()["growths"] == 2


def test_hysteresis_refilled_on_growth_as_megatron() -> None:
    scaler = dscale.GradScaler("cpu", init_scale=64.0, growth_interval=2, hysteresis=2)
    # overflow (tolerated), clean, overflow (backs off: not refilled by the clean step),
    # overflow (backs off again), clean, clean (grows: refilled), overflow (tolerated)
    assert _drive(scaler, [1, 0, 1, 1, 0, 0, 1]) == [64.0, 64.0, 32.0, 16.0, 16.0, 32.0, 32.0]
    assert scaler.snapshot()["skipped_steps"] == 4


def test_hysteresis_refilled_by_every_clean_step_as_deepspeed_consecutive() -> None:
    scaler = dscale.GradScaler(
        "cpu",
        init_scale=64.0,
        growth_interval=100,
        hysteresis=2,
        hysteresis_refill="on_clean_step",
    )
    # Isolated overflows are all tolerated; two in a row back off.
    assert _drive(scaler, [1, 0, 1, 0, 1, 1]) == [64.0, 64.0, 64.0, 64.0, 64.0, 32.0]


def test_stuck_at_min_scale_raises_naming_the_step_and_the_skips_in_a_row() -> None:
    scaler = dscale.GradScaler(
        "cpu", init_scale=2.0, min_scale=1.0, on_stuck_at_min="raise", stuck_patience=5
    )
    with pytest.raises(dscale.ScaleCollapsedError, match=r"last 5 steps in a row.*step index 4"):
        _drive(scaler, [1] * 10)
    assert scaler.get_scale() == 1.0


def test_stuck_at_min_scale_warns_and_training_goes_on(caplog) -> None:
    scaler = dscale.GradScaler("cpu", init_scale=1.0, min_scale=1.0, stuck_patience=3)
    with caplog.at_level(logging.WARNING, logger="dscale.scaler"):
        _drive(scaler, [1, 1, 1, 0, 1])
    assert len([r for r in caplog.records if "stuck at min_scale" in r.message]) == 1


def test_overflows_that_are_not_at_the_minimum_never_trip_the_stuck_policy() -> None:
    scaler = dscale.GradScaler(
        "cpu", init_scale=2.0**20, min_scale=1.0, on_stuck_at_min="raise", stuck_patience=3
    )
    _drive(scaler, [1] * 6)  # still far above min_scale
    assert scaler.get_scale() == 2.0**14


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"min_scale": 2.0**10, "max_scale": 2.0**14, "stuck_patience": 10_000},
        {"hysteresis": 3},
        {"hysteresis": 2, "hysteresis_refill": "on_clean_step", "growth_factor": 3.0},
        {"backoff_factor": 0.3, "growth_factor": 1.7, "max_scale": 1e9},
        # torch's rule (no clamp, hysteresis 1): the device runs torch's own kernel.
        {"hysteresis_refill": "on_clean_step"},
        {"backoff_factor": 0.3, "growth_factor": 1.7},
    ],
)
def test_host_and_device_updates_follow_the_same_rule_exactly(kwargs) -> None:
    # Plain steps update on the host; sync_free steps update with device ops. Same trajectory.
    pattern = [int(i % 7 == 0 or i % 11 in (3, 4) or i % 23 > 20) for i in range(150)]
    host = dscale.GradScaler("cpu", init_scale=2.0**12, growth_interval=3, **kwargs)
    device = decide_on_device(
        dscale.GradScaler("cpu", init_scale=2.0**12, growth_interval=3, sync_free=True, **kwargs)
    )
    for i, overflow in enumerate(pattern):
        if i == 100:  # lowered mid-run, below the trackers' count: both must grow at once
            for scaler in (host, device):
                scaler.set_growth_interval(1)
        _drive(host, [overflow])
        _drive(device, [overflow])
        assert host.state_dict() == device.state_dict(), i
    assert host.snapshot()["backoffs"] > 5
    assert host.snapshot()["growths"] > 5


def test_torchs_rule_updates_on_the_device_with_torchs_kernel(monkeypatch) -> None:
    calls = []
    real = torch._amp_update_scale_
    monkeypatch.setattr(torch, "_amp_update_scale_", lambda *a: calls.append(1) or real(*a))
    for kwargs, expected in (({}, 3), ({"hysteresis": 2}, 0), ({"max_scale": 2.0**20}, 0)):
        calls.clear()
        _drive(decide_on_device(dscale.GradScaler("cpu", sync_free=True, **kwargs)), [0, 1, 0])
        assert len(calls) == expected, kwargs


def test_after_plain_steps_the_scale_is_read_without_touching_the_device(monkeypatch) -> None:
    scaler = dscale.GradScaler("cpu", init_scale=64.0, growth_interval=2)
    _drive(scaler, [0, 1, 0, 0])
    reads = []
    real = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(1) or real(self))
    assert scaler.get_scale() == 64.0
    assert scaler.state_dict()["num_steps"] == 4
    assert reads == []
    # counters() is brought up to date from the host copy.
    assert int(scaler.counters()["steps"]) == 4
