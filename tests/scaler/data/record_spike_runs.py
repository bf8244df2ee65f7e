"""Record the spike gate's decisions and state over long random runs (test_spike_gate's oracle).

Run from a checkout: ``PYTHONPATH=. python tests/scaler/data/record_spike_runs.py OUT [NAME...]``
(names: record only those runs, keeping the others in OUT). The recorded file
(``spike_runs.json``) holds six runs made at e6f0fe2, before the gate was rewritten in a handful of
ops, and two single-signal runs made at 0010076, before its second rewrite; the test replays them
on the current code and compares every step's decision and the state dicts bit for bit (floats as
hex).
"""

from __future__ import annotations

import json
import math
import random
import sys
from typing import Any

import torch

import dscale

# (name, kind, sync_free, device path, optimizer impl, window, warmup, sigma, steps, seed[,
# signals]): the first six recorded at e6f0fe2, the single-signal two at 0010076 (the gate before
# its second rewrite, whose decisions on the first six equal e6f0fe2's).
RUNS = (
    ("guard_host", "guard", False, False, "foreach", 16, 8, 3.0, 700, 1),
    ("guard_fused_device", "guard", False, True, "fused", 16, 8, 3.0, 700, 2),
    ("guard_sync_free", "guard", True, True, "foreach", 12, 5, 2.5, 500, 3),
    ("scaler_host", "scaler", False, False, "foreach", 16, 8, 3.0, 600, 4),
    ("scaler_fused_device", "scaler", False, True, "fused", 32, 16, 3.0, 600, 5),
    ("guard_default_window", "guard", False, True, "fused", 128, 64, 6.0, 500, 6),
    ("guard_loss_only", "guard", False, True, "fused", 16, 8, 3.0, 500, 7, ("loss",)),
    ("scaler_grad_norm_only", "scaler", True, True, "foreach", 12, 5, 2.5, 500, 8, ("grad_norm",)),
)


def _hex(x: float) -> str:
    return float(x).hex()


def _state(scaler: Any) -> dict[str, Any]:
    s = scaler.state_dict()
    out = {k: s[k] for k in ("spike_window_entered", "num_spike_skipped_steps")}
    out["num_spike_skipped_in_a_row"] = s["num_spike_skipped_in_a_row"]
    out["spike_window_values"] = [
        [_hex(v) for v in row] for row in s["spike_window_values"].tolist()
    ]
    out["scale"] = _hex(s["scale"])
    return out


def run(
    name: str,
    kind: str,
    sync_free: bool,
    device: bool,
    impl: str,
    window: int,
    warmup: int,
    sigma: float,
    steps: int,
    seed: int,
    signals: tuple[str, ...] = ("loss", "grad_norm"),
) -> dict[str, Any]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (5, 3, 7)]
    flags = {"fused": True} if impl == "fused" else {"foreach": True}
    opt = torch.optim.SGD(params, lr=1e-3, **flags)
    gate = {
        "spike_signals": signals,
        "spike_window": window,
        "spike_warmup": warmup,
        "spike_sigma": sigma,
    }
    if kind == "guard":
        scaler: Any = dscale.StepGuard("cpu", sync_free=sync_free, **gate)
    else:
        scaler = dscale.GradScaler(
            "cpu", init_scale=2.0**10, growth_interval=50, sync_free=sync_free, **gate
        )
    if device:
        scaler._read_host_flags = False
    level, grad_level = 2.0, 1.0
    decisions, snapshots, states = [], [], []
    for step in range(steps):
        level *= math.exp(rng.gauss(0.0, 0.01))
        grad_level *= math.exp(rng.gauss(0.0, 0.02))
        loss = level * (1.0 + 0.02 * rng.gauss(0.0, 1.0))
        g = grad_level
        r = rng.random()
        if r < 0.03:
            loss *= rng.choice([1.5, 3.0, 20.0])  # a loss spike
        elif r < 0.06:
            g *= rng.choice([2.0, 5.0, 100.0])  # a grad-norm spike
        elif r < 0.07:
            loss = rng.choice([math.nan, math.inf])  # a loss that is not finite
        scale = scaler.get_scale() if kind == "scaler" else 1.0
        out = scaler.scale(torch.tensor(loss, dtype=torch.float32))
        del out
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * g * scale
        if rng.random() < 0.03:
            params[1].grad[0] = math.inf  # an overflow
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        applied = any(not torch.equal(b, p) for b, p in zip(before, params))
        scaler.update()
        snap = scaler.snapshot()
        decisions.append("1" if applied else "0")
        if step % 7 == 0:
            snapshots.append(
                [
                    snap["spike_skipped_steps"],
                    snap["spike_skipped_in_a_row"],
                    snap["spike_window_values"],
                    _hex(snap.get("spike_loss", math.nan)),  # NaN: not watched
                    _hex(snap.get("spike_grad_norm", math.nan)),
                ]
            )
        if step % 97 == 0 or step == steps - 1:
            states.append([step, _state(scaler)])
    return {"decisions": "".join(decisions), "snapshots": snapshots, "states": states}


def main(path: str, names: list[str]) -> None:
    """Record RUNS (or those named) into ``path``, keeping what it holds for the others."""
    try:
        with open(path) as f:
            out = json.load(f)
    except FileNotFoundError:
        out = {}
    out |= {r[0]: run(*r) for r in RUNS if not names or r[0] in names}
    with open(path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
