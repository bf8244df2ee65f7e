"""The device path reads back what the host path holds: snapshot(), counters(), state_dict().

A CUDA run decides fused and ``sync_free`` steps on the device and keeps its state there; the CPU
decides them on the host. The two must be indistinguishable to a reader: the oracle for every
device-path read is the host path over the same run. The runs are long and random: overflows,
steps that measure nothing, ``update(new_scale=...)`` (a float or a tensor), and reads of
``counters()`` (which fold the device log) at random steps, the same in both runs.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from torch import nn

import dscale
from tests.scaler._setup import decide_on_device

pytestmark = pytest.mark.filterwarnings("ignore:dscale.GradScaler.*:UserWarning")

STEPS = 60


def _plan(seed: int) -> list[dict[str, Any]]:
    """What each step does, drawn once so that both runs follow it."""
    rng = random.Random(seed)
    plan = []
    for _ in range(STEPS):
        event = rng.random()
        plan.append(
            {
                "overflow": event < 0.15,
                "empty": 0.15 <= event < 0.22,  # every grad zero: nothing measured
                "weight": rng.choice([1.0, 1.0, 1.0, 8.0, 0.125]),
                "new_scale": (
                    rng.choice([2.0**7, 2.0**12, 2.0**20]) if rng.random() < 0.1 else None
                ),
                "as_tensor": rng.random() < 0.5,
                # The launcher's metrics log reads counters() after each update (a fold of
                # the device log); a scrape thread reads snapshot(wait=False).
                "reads": rng.choice(READS),
            }
        )
    return plan


READS = (
    ("snapshot",),
    ("counters", "snapshot"),
    ("snapshot", "counters"),
    ("counters", "no_wait"),
)


def _values(scaler: dscale.GradScaler, reads: tuple[str, ...]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for read in reads:
        if read == "counters":
            values.update({f"counters.{k}": v.item() for k, v in scaler.counters().items()})
        else:
            snap = scaler.snapshot(wait=read == "snapshot")
            values.update({f"{read}.{k}": v for k, v in snap.items()})
    return values


def _run(
    kwargs: dict[str, Any], make_opt, plan: list[dict[str, Any]], on_device: bool
) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = make_opt(model.parameters())
    cls = dscale.StepGuard if kwargs.get("guard") else dscale.GradScaler
    scaler = cls("cpu", **{k: v for k, v in kwargs.items() if k != "guard"})
    if on_device:
        decide_on_device(scaler)
    trace = []
    for step, todo in enumerate(plan):
        opt.zero_grad()
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().mean() * todo["weight"] * (0.0 if todo["empty"] else 1.0)
        scaler.scale(loss).backward()
        if todo["overflow"]:
            model[2].weight.grad[0, 0] = math.inf
        scaler.step(opt)
        new_scale = todo["new_scale"]
        if new_scale is not None and not kwargs.get("guard"):
            # A tensor moves the state to the device for good: the host run takes the float.
            as_tensor = todo["as_tensor"] and on_device
            scaler.update(torch.tensor(new_scale) if as_tensor else new_scale)
        else:
            scaler.update()
        values = _values(scaler, todo["reads"])
        for key, value in scaler.state_dict().items():  # tensors: the spike gate's window
            values[f"state_dict.{key}"] = repr(value.tolist()) if torch.is_tensor(value) else value
        trace.append(values)
    return trace, [p.detach().clone() for p in model.parameters()]


def _differences(host: list[dict[str, Any]], device: list[dict[str, Any]]) -> list[str]:
    def same(a: Any, b: Any) -> bool:
        return (isinstance(a, float) and math.isnan(a) and math.isnan(b)) or a == b

    out = []
    for step, (h, d) in enumerate(zip(host, device, strict=True)):
        assert h.keys() == d.keys(), step
        out += [
            f"step {step} {k}: host {h[k]!r}, device {d[k]!r}" for k in h if not same(h[k], d[k])
        ]
    return out


SCALERS = {
    "predictive": {"policy": "predictive", "growth_interval": 5},
    "predictive-hysteresis": {"policy": "predictive", "growth_interval": 5, "hysteresis": 2},
    "predictive-backoff": {"policy": "predictive", "growth_interval": 5, "backoff_factor": 0.25},
    "predictive-min-max": {
        "policy": "predictive",
        "growth_interval": 5,
        "min_scale": 2.0**4,
        "max_scale": 2.0**16,
    },
    "predictive-spike": {
        "policy": "predictive",
        "growth_interval": 5,
        "spike_signals": ("loss",),
        "spike_warmup": 4,
        "spike_window": 8,
    },
    "dynamic": {"growth_interval": 3},
    "dynamic-hysteresis": {"growth_interval": 3, "hysteresis": 3, "min_scale": 2.0},
    "dynamic-spike": {"growth_interval": 3, "spike_signals": ("loss",), "spike_warmup": 4},
    "step-guard": {"guard": True},
}
STEPPERS = {
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
    "sgd-sync-free": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=True),
}


@pytest.mark.parametrize("name", sorted(SCALERS))
def test_every_device_path_read_equals_the_host_paths_over_a_long_random_run(name) -> None:
    failures = []
    for stepper, make_opt in STEPPERS.items():
        kwargs = dict(SCALERS[name], init_scale=2.0**10)
        if kwargs.get("guard"):
            kwargs.pop("init_scale")
        if stepper == "sgd-sync-free":
            kwargs["sync_free"] = True
        plan = _plan(seed=len(name))
        host, host_params = _run(kwargs, make_opt, plan, on_device=False)
        device, device_params = _run(kwargs, make_opt, plan, on_device=True)
        failures += [f"{stepper}: {d}" for d in _differences(host, device)]
        for p, q in zip(host_params, device_params, strict=True):
            if not torch.equal(p, q):
                failures.append(f"{stepper}: parameters differ")
                break
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} in all)"


def test_grad_max_abs_of_an_overflowed_step_survives_a_fold_and_a_set_scale() -> None:
    """Issue 33 item 5, as the launcher's metrics log meets it: counters() after each update
    folds the device log, and snapshot() then read 0.0 ("measured nothing") for an overflowed
    step, and after update(new_scale=...) the hold entry of the step before as a huge value.
    Oracle: the host path, which keeps the last step's telemetry through both."""
    plan = [
        {"overflow": False, "empty": False, "weight": 1.0, "new_scale": None},
        {"overflow": True, "empty": False, "weight": 1.0, "new_scale": None},
        {"overflow": False, "empty": False, "weight": 1.0, "new_scale": 2.0**12},
        {"overflow": False, "empty": True, "weight": 1.0, "new_scale": None},
        {"overflow": False, "empty": False, "weight": 1.0, "new_scale": 2.0**3},
        {"overflow": False, "empty": False, "weight": 1.0, "new_scale": None},
    ]
    plan = [dict(todo, as_tensor=True, reads=("counters", "snapshot")) for todo in plan]
    kwargs = {"policy": "predictive", "init_scale": 2.0**10}
    make_opt = STEPPERS["adam-fused"]
    host, _ = _run(kwargs, make_opt, plan, on_device=False)
    device, _ = _run(kwargs, make_opt, plan, on_device=True)
    got = [d["snapshot.grad_max_abs"] for d in device]
    expected = [h["snapshot.grad_max_abs"] for h in host]
    assert math.isnan(expected[1]) and math.isnan(expected[2]), expected  # overflow, then set
    assert expected[3] == 0.0 and expected[4] == 0.0 and expected[5] > 0, expected
    assert _differences(host, device) == [], (expected, got)


@pytest.mark.parametrize("on_device", [False, True], ids=["host-path", "device-path"])
def test_a_pickled_copy_reads_what_the_scaler_reads(on_device) -> None:
    """pickle and copy.deepcopy kept the rings but dropped what the last update measured: the
    copy's snapshot() gave grad_max_abs NaN (the value that means "overflowed") and target_scale
    NaN after an ordinary step. Oracle: the original scaler's snapshot(), every field, every
    step of a random run (overflows, zero grads, update(new_scale=...)), both paths."""
    import copy
    import pickle

    failures = []
    plan = _plan(seed=3)[:30]
    for name in ("predictive", "predictive-hysteresis", "predictive-spike"):
        for stepper, make_opt in STEPPERS.items():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
            opt = make_opt(model.parameters())
            kwargs = dict(SCALERS[name], init_scale=2.0**10, sync_free=stepper == "sgd-sync-free")
            scaler = dscale.GradScaler("cpu", **kwargs)
            if on_device:
                decide_on_device(scaler)
            for step, todo in enumerate(plan):
                opt.zero_grad()
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
                loss = model(x).square().mean() * (0.0 if todo["empty"] else todo["weight"])
                scaler.scale(loss).backward()
                if todo["overflow"]:
                    model[2].weight.grad[0, 0] = math.inf
                scaler.step(opt)
                scaler.update(todo["new_scale"])
                want = scaler.snapshot()
                for how, copied in (
                    ("pickle", pickle.loads(pickle.dumps(scaler))),
                    ("deepcopy", copy.deepcopy(scaler)),
                ):
                    got = copied.snapshot()
                    failures += [
                        f"{name} {stepper} step {step} {how} {k}: {want[k]!r} -> {got[k]!r}"
                        for k in want
                        if not (want[k] == got[k] or (math.isnan(want[k]) and math.isnan(got[k])))
                    ]
    assert not failures, "\n".join(failures[:12]) + f"\n({len(failures)} in all)"
