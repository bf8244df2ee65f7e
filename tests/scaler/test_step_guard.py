"""StepGuard and the spike gate in one process: what they skip, keep, save and refuse."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import dscale

GATE = {"spike_signals": ("loss",), "spike_window": 8, "spike_warmup": 4}
SPIKE = 9  # the step whose loss is multiplied by 1000 in _train


def _train(guard, *, steps: int = 14, opt_kind: str = "sgd", spike_at: int | None = SPIKE):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-2)
        if opt_kind == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    g = torch.Generator().manual_seed(1)
    applied = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(8, 4, generator=g)).square().mean()
        if step == spike_at:
            loss = loss * 1000
        if guard is None:
            loss.backward()
            opt.step()
            continue
        guard.scale(loss).backward()
        guard.step(opt)
        applied.append(guard.step_applied())
        guard.update()
    return model, applied


def test_step_guard_does_not_scale_and_trains_exactly_as_plain_fp32() -> None:
    guard = dscale.StepGuard("cpu")
    loss = torch.ones((), requires_grad=True) * 3
    assert guard.scale(loss) is loss
    guarded, applied = _train(guard, spike_at=None)
    plain, _ = _train(None, spike_at=None)
    assert all(applied)
    assert torch.equal(guarded.weight, plain.weight)
    assert guard.get_scale() == 1.0 and guard.snapshot()["growths"] == 0
    assert "loss_scaling" in guard.state_dict() and guard.state_dict()["scale"] == 1.0


def test_a_spike_is_skipped_counted_apart_and_reported_to_step_callbacks() -> None:
    guard = dscale.StepGuard("cpu", **GATE)
    seen = []
    guard.register_step_callback(lambda opt, applied: seen.append(applied))
    _, applied = _train(guard)
    assert applied == [s != SPIKE for s in range(14)]
    assert seen == applied  # what LR schedulers and framework integrations hear
    snap = guard.snapshot()
    assert snap["spike_skipped_steps"] == 1 and snap["skipped_steps"] == 0
    assert snap["spike_window_values"] == 8
    # Without the gate the same spike lands.
    _, ungated = _train(dscale.StepGuard("cpu"))
    assert all(ungated)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"policy": "predictive"},
        {"sync_free": True},
        {"min_scale": 1.0, "hysteresis": 2},
    ],
    ids=["predictive", "sync_free", "hysteresis"],
)
def test_the_gate_works_with_gradscaler_options_and_keeps_the_scale(kwargs) -> None:
    scaler = dscale.GradScaler("cpu", init_scale=1024.0, **GATE, **kwargs)
    _, applied = _train(scaler, opt_kind="adamw")
    assert applied[SPIKE] is False
    snap = scaler.snapshot()
    assert snap["spike_skipped_steps"] == 1 and snap["skipped_steps"] == 0
    if "policy" not in kwargs:  # predictive sets the scale from its measurement instead
        assert snap["backoffs"] == 0 and snap["scale"] == 1024.0


def test_clipping_after_unscale_sees_the_same_skip() -> None:
    guard = dscale.StepGuard("cpu", spike_signals=("grad_norm",), spike_window=8, spike_warmup=4)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    applied = []
    for step in range(12):
        opt.zero_grad()
        loss = model(torch.randn(8, 4)).square().mean() * (1000 if step == 9 else 1)
        guard.scale(loss).backward()
        guard.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the norm before clipping counts
        guard.step(opt)
        applied.append(guard.step_applied())
        guard.update()
    assert applied == [s != 9 for s in range(12)]


def test_fp16_optimizer_takes_the_gate_through_dynamic_loss_args() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2).half()
    opt = dscale.FP16Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 128.0, "device": "cpu", **GATE},
    )
    skipped = []
    for step in range(12):
        opt.zero_grad()
        out = model(torch.randn(8, 4).half()).float()
        opt.backward(out.square().mean() * (1000 if step == 9 else 1))
        opt.step()
        skipped.append(opt.overflow)
    assert skipped == [s == 9 for s in range(12)]


def test_the_window_survives_state_dict_and_pickle_and_a_resume_decides_alike() -> None:
    guard = dscale.StepGuard("cpu", **GATE)
    _train(guard, steps=7, spike_at=None)
    state = guard.state_dict()
    assert state["dscale_format_version"] == 3 and state["spike_window_entered"] == 7
    resumed = dscale.StepGuard("cpu", **GATE)
    resumed.load_state_dict(state)
    for other in (resumed, pickle.loads(pickle.dumps(guard)), copy.deepcopy(guard)):
        got = other.state_dict()
        assert torch.equal(got["spike_window_values"], state["spike_window_values"])
        assert got["spike_window_entered"] == 7


def test_a_bad_spike_state_dict_is_refused_whole() -> None:
    guard = dscale.StepGuard("cpu", **GATE)
    _train(guard, steps=5, spike_at=None)
    before = guard.state_dict()
    wrong = dict(before, spike_window_values=torch.zeros(1, 16))
    with pytest.raises(ValueError, match="spike_window_values has shape"):
        guard.load_state_dict(wrong)
    with pytest.raises(ValueError, match="spike_signals="):
        guard.load_state_dict(dict(before, spike_signals="grad_norm"))
    assert torch.equal(guard.state_dict()["spike_window_values"], before["spike_window_values"])


def test_a_step_guard_dict_and_a_gradscaler_dict_cross_as_documented() -> None:
    guard = dscale.StepGuard("cpu")
    _train(guard, steps=3, spike_at=None)
    with pytest.raises(ValueError, match="saved by a StepGuard"):
        dscale.GradScaler("cpu").load_state_dict(guard.state_dict())
    scaler = dscale.GradScaler("cpu", init_scale=1024.0)
    _train(scaler, steps=3, spike_at=None)
    guard.load_state_dict(scaler.state_dict())
    assert guard.get_scale() == 1.0 and guard.snapshot()["steps"] == 3


def test_with_the_gate_off_the_state_dict_and_snapshot_are_unchanged() -> None:
    scaler = dscale.GradScaler("cpu")
    _train(scaler, steps=2, spike_at=None)
    assert scaler.state_dict()["dscale_format_version"] == 1
    assert not [k for k in scaler.state_dict() if "spike" in k or k == "loss_scaling"]
    assert not [k for k in scaler.snapshot() if "spike" in k]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"spike_signals": "loss"}, "spike_signals must be a list or tuple"),
        ({"spike_signals": ("loss", "lr")}, r"spike_signals has \['lr'\]"),
        ({"spike_signals": ("loss",), "spike_sigma": 0}, "spike_sigma must be"),
        ({"spike_signals": ("loss",), "spike_window": 1}, "spike_window must be"),
        ({"spike_signals": ("loss",), "spike_warmup": 200}, r"spike_warmup must be .*128"),
    ],
)
def test_bad_gate_arguments_name_the_argument_and_the_fix(kwargs, match) -> None:
    for cls in (dscale.GradScaler, dscale.StepGuard):
        with pytest.raises(ValueError, match=match):
            cls("cpu", **kwargs)


def test_misuse_raises_with_the_fix() -> None:
    guard = dscale.StepGuard("cpu", **GATE)
    model_a, model_b = nn.Linear(2, 1), nn.Linear(2, 1)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1)
    guard.scale(model_a(torch.ones(1, 2)).sum() + model_b(torch.ones(1, 2)).sum()).backward()
    guard.step(opt_a)
    with pytest.raises(RuntimeError, match="second optimizer"):
        guard.step(opt_b)
    with pytest.raises(RuntimeError, match="no scale to set"):
        guard.update(new_scale=2.0)
    no_loss = dscale.StepGuard("cpu", **GATE)
    model_a(torch.ones(1, 2)).sum().backward()
    no_loss.scale(torch.ones(()))  # places it, but the next iteration has no scale() call
    no_loss._spike.end_iteration()
    with pytest.raises(RuntimeError, match="no loss was passed to scale"):
        no_loss.step(opt_a)


def test_the_bf16_warning_points_to_step_guard() -> None:
    from dscale.scaler import _warnings

    _warnings._checked = False
    scaler = dscale.GradScaler("cpu")
    with pytest.warns(UserWarning, match="dscale.StepGuard"):
        scaler.scale(nn.Linear(2, 1).bfloat16()(torch.ones(1, 2).bfloat16()).sum())


def test_the_device_path_keeps_the_same_state_as_the_host_path() -> None:
    """A fused step (forced to the device-side decision) against a plain one, with overflows
    and a short growth interval: the same state dict after every step."""
    import math

    from dscale.bench._ops import force_device_decision

    def run(device_form: bool) -> list[dict]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=device_form)
        guard = dscale.StepGuard("cpu")
        guard._growth_interval = 3  # the tracker wraps, as the clamped rule wraps it
        if device_form:
            force_device_decision(guard)
        out = []
        for step in range(40):
            guard.scale(model(torch.randn(4, 8)).square().mean()).backward()
            if step % 7 == 3:
                model.weight.grad[0, 0] = math.inf
            guard.step(opt)
            guard.update()
            opt.zero_grad()
            out.append(guard.state_dict())
        return out

    host, device = run(False), run(True)
    assert host == device
    assert host[-1]["num_skipped_steps"] == 6 and host[-1]["scale"] == 1.0
