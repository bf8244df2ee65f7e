"""The walk of ``optimizer`` from ``GradScaler.step``: each module entered once (issue 34).

A reader follows a gradient from step() through the check, the agreement and the decision to the
optimizer's own step without bouncing between modules. This traces every call that receives the
optimizer (a frame holding it) inside ``dscale/`` during one step() and counts how often each
module is entered from another one: at most once each, and never back into ``scaler/_api.py`` (a
callback from a helper into the scaler is the bounce this guards against).
"""

from __future__ import annotations

import collections
import functools
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

import dscale
from dscale.bench._ops import force_device_decision

_OPTIMIZERS = {
    "sgd_foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=0.1, fused=True),
}
_SCALERS = {
    "dynamic": lambda: dscale.GradScaler("cpu", init_scale=1024.0),
    "sync_free": lambda: dscale.GradScaler("cpu", init_scale=1024.0, sync_free=True),
    "predictive": lambda: dscale.GradScaler("cpu", policy="predictive"),
    "spike_gate": lambda: dscale.StepGuard("cpu", spike_signals=("loss", "grad_norm")),
}


# The imported package's own folder, not any path with "/dscale/" in it: a clone in a folder
# named dscale (/tmp/x/dscale/tests/...) would count this test file as a dscale module.
_PACKAGE = Path(dscale.__file__).resolve().parent


@functools.cache
def _in_package(filename: str) -> str | None:
    """The file relative to the dscale package ("scaler/_api.py"), None outside it."""
    path = Path(filename).resolve()
    return path.relative_to(_PACKAGE).as_posix() if path.is_relative_to(_PACKAGE) else None


def _module(frame: FrameType | None) -> str | None:
    return None if frame is None else _in_package(frame.f_code.co_filename)


def _walk(optimizer_name: str, scaler_name: str, device_side: bool) -> list[tuple[str, str]]:
    """(caller module, callee module) of each call into a dscale frame holding the optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = _OPTIMIZERS[optimizer_name](model.parameters())
    scaler = _SCALERS[scaler_name]()
    if device_side:
        force_device_decision(scaler)
    entries: list[tuple[str, str]] = []

    def trace(frame: FrameType, event: str, arg: Any) -> None:
        callee = _module(frame)
        if event != "call" or callee is None:
            return
        if any(value is opt for value in frame.f_locals.values()):
            entries.append((_module(frame.f_back) or "user", callee))

    for step in range(3):  # the last step is the steady state, state created
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        if step == 2:
            sys.setprofile(trace)
        try:
            scaler.step(opt)
        finally:
            sys.setprofile(None)
        scaler.update()
    return entries


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("device_side", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("scaler_name", list(_SCALERS))
@pytest.mark.parametrize("optimizer_name", list(_OPTIMIZERS))
def test_step_enters_each_module_once(optimizer_name, scaler_name, device_side):
    entries = _walk(optimizer_name, scaler_name, device_side)
    crossings = [(caller, callee) for caller, callee in entries if caller != callee]
    assert crossings[0] == ("user", "scaler/_api.py")
    counts = collections.Counter(callee for _, callee in crossings[1:])
    assert counts["scaler/_api.py"] == 0, crossings  # nothing calls back into the scaler
    assert all(n == 1 for n in counts.values()), crossings
