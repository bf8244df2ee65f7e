"""Record scalers pickled by an earlier dscale, and how they go on (test_api's oracle).

Run at the commit to record from: ``PYTHONPATH=<checkout> python
tests/scaler/data/record_old_pickles.py OUT``. ``old_pickles.json`` was recorded at 0010076, the
step path before its split into stage modules: each run trains a few steps, pickles the scaler
(base64), unpickles it on that same code and trains on, recording every step's decision, the
snapshot and the state dict (floats as hex). The test unpickles the bytes on the current code and
must go on bit for bit alike.
"""

from __future__ import annotations

import base64
import json
import math
import pickle
import sys
from typing import Any

import torch

import dscale

GATE = {"spike_window": 4, "spike_warmup": 2, "spike_sigma": 3.0}
# name -> (kind, keyword arguments)
RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    "dynamic": ("scaler", {}),
    "predictive": ("scaler", {"policy": "predictive"}),
    "spike_gate": ("scaler", {"spike_signals": ("loss", "grad_norm"), **GATE}),
    "predictive_spike_gate": (
        "scaler",
        {"policy": "predictive", "spike_signals": ("loss",), **GATE},
    ),
    "step_guard_spike_gate": ("guard", {"spike_signals": ("grad_norm",), **GATE}),
}


def make(kind: str, kwargs: dict[str, Any]) -> Any:
    if kind == "guard":
        return dscale.StepGuard("cpu", **kwargs)
    return dscale.GradScaler("cpu", init_scale=2.0**10, growth_interval=3, **kwargs)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return float(value).hex()


def train(scaler: Any, steps: int, seed: int) -> list[Any]:
    """``steps`` iterations on fixed grads (an overflow, a loss and a grad spike among them)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (5, 3)]
    opt = torch.optim.SGD(params, lr=1e-2)
    trace = []
    for step in range(steps):
        loss = 2.0 + 0.01 * step + (50.0 if step == 9 else 0.0)
        scale = scaler.get_scale()
        scaler.scale(torch.tensor(loss))
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * scale * (100.0 if step == 10 else 1.0)
        if step == 3:
            params[1].grad[0] = math.inf
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        applied = any(not torch.equal(b, p) for b, p in zip(before, params, strict=True))
        scaler.update()
        snap = scaler.snapshot()
        trace.append([applied, {k: _plain(snap[k]) for k in sorted(snap)}])
    state = scaler.state_dict()
    trace.append({k: _plain(state[k]) for k in sorted(state)})
    trace.append([_plain(p.detach()) for p in params])
    return trace


def record() -> dict[str, Any]:
    out = {}
    for name, (kind, kwargs) in RUNS.items():
        scaler = make(kind, kwargs)
        train(scaler, 6, 0)
        data = pickle.dumps(scaler)
        out[name] = {
            "pickle": base64.b64encode(data).decode(),
            "after": train(pickle.loads(data), 12, 1),
        }
    return out


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        json.dump(record(), f)
