"""State dicts travel between torch's and dscale's scalers; a resumed run continues exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dscale

pytestmark = pytest.mark.filterwarnings("ignore:dscale.GradScaler.*:UserWarning")


def _run(scaler, model, opt, steps, poison_at=(), start=0):
    for step in range(start, start + steps):
        torch.manual_seed(step)
        opt.zero_grad()
        scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        if step in poison_at:
            model.weight.grad[0, 0] = float("nan")
        scaler.step(opt)
        scaler.update()


def test_torch_state_dict_loads_into_dscale_and_back() -> None:
    theirs = torch.amp.GradScaler("cpu", init_scale=4096.0, growth_interval=3)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    _run(theirs, model, opt, 5, poison_at={1})
    ours = dscale.GradScaler("cpu")
    ours.load_state_dict(theirs.state_dict())
    for key, value in theirs.state_dict().items():
        assert ours.state_dict()[key] == value
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())
    assert back.state_dict() == theirs.state_dict()


def test_state_dict_has_every_tracker_and_a_format_version() -> None:
    scaler = dscale.GradScaler("cpu", hysteresis=2, min_scale=1.0, growth_interval=2)
    model = nn.Linear(4, 2)
    _run(scaler, model, torch.optim.SGD(model.parameters(), lr=0.0), 5, poison_at={1, 2})
    sd = scaler.state_dict()
    assert sd["dscale_format_version"] == 1
    assert sd["num_steps"] == 5
    assert sd["num_skipped_steps"] == 2
    assert sd["num_backoffs"] == 1  # hysteresis 2: the second overflow in a row backs off
    assert sd["num_growths"] == 1
    assert sd["_hysteresis_tracker"] == 2  # refilled by the growth at step 4
    assert {"min_scale", "max_scale", "hysteresis", "hysteresis_refill"} <= set(sd)


def test_resumed_run_continues_exactly_as_an_uninterrupted_one() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    kwargs = {"init_scale": 2.0**12, "growth_interval": 3, "hysteresis": 2}
    poison = {2, 3, 9, 10, 11}
    full_model = copy.deepcopy(model)
    full = dscale.GradScaler("cpu", **kwargs)
    _run(full, full_model, torch.optim.SGD(full_model.parameters(), lr=0.01), 16, poison)

    first = dscale.GradScaler("cpu", **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _run(first, model, opt, 8, poison)
    saved = copy.deepcopy(first.state_dict())
    resumed = dscale.GradScaler("cpu")  # defaults: everything must come from the dict
    resumed.load_state_dict(saved)
    _run(resumed, model, opt, 8, poison, start=8)
    assert resumed.state_dict() == full.state_dict()
    assert torch.equal(model.weight, full_model.weight)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"scale": -1.0}, "init_scale"),
        ({"scale": float("nan")}, "init_scale"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"_growth_tracker": -3}, "_growth_tracker"),
        ({"min_scale": 10.0, "max_scale": 1.0}, "min_scale"),
        ({"hysteresis_refill": "sometimes"}, "hysteresis_refill"),
        ({"hysteresis": 1, "_hysteresis_tracker": 5}, "exceeds hysteresis=1"),
        ({"dscale_format_version": 99}, "newer"),
        ({"scale": None}, "init_scale"),
    ],
)
def test_rejected_state_dict_leaves_scaler_unchanged(change, match) -> None:
    scaler = dscale.GradScaler("cpu", init_scale=256.0, growth_interval=4)
    scaler.scale(torch.tensor(1.0))
    before = scaler.state_dict()
    with pytest.raises(ValueError, match=match):
        scaler.load_state_dict({**before, **change})
    assert scaler.state_dict() == before


def test_state_dict_missing_keys_or_empty_is_a_clear_error() -> None:
    scaler = dscale.GradScaler("cpu")
    with pytest.raises(ValueError, match="empty"):
        scaler.load_state_dict({})
    with pytest.raises(ValueError, match="lacks"):
        scaler.load_state_dict({"scale": 2.0})
    with pytest.raises(ValueError, match="must be a dict"):
        scaler.load_state_dict([("scale", 2.0)])  # type: ignore[arg-type]


def test_tensor_values_from_a_dcp_round_trip_are_accepted() -> None:
    src = dscale.GradScaler("cpu", init_scale=64.0)
    sd = {
        k: torch.tensor(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
        for k, v in src.state_dict().items()
    }
    dst = dscale.GradScaler("cpu")
    dst.load_state_dict(sd)
    assert dst.get_scale() == 64.0
