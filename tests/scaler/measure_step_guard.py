"""What the step guard costs: ops per iteration (the op-count benchmark's method) and CPU time.

    python tests/scaler/measure_step_guard.py

Ops: ``dscale.bench``'s counter, on the device-side decision path (as on CUDA), the optimizer's own
ops subtracted, for a GradScaler (fp16 arm of ``python -m dscale.bench ops``), a StepGuard, and a
StepGuard with the spike gate on the loss and the grad norm. Time: a 2-layer MLP trained on the
CPU for 300 steps, plain AdamW against each guard, interleaved, median of 5 rounds.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
from torch import nn

import dscale
from dscale.bench import _ops
from dscale.bench._op_count import count_ops

ARMS = {
    "GradScaler": lambda: dscale.GradScaler("cpu", init_scale=_ops.INIT_SCALE),
    "StepGuard": lambda: dscale.StepGuard("cpu"),
    "StepGuard+spike": lambda: dscale.StepGuard("cpu", spike_signals=("loss", "grad_norm")),
    "StepGuard+spike sync_free": lambda: dscale.StepGuard(
        "cpu", sync_free=True, spike_signals=("loss", "grad_norm")
    ),
}


def ops(row: _ops.Row, make) -> float:
    setup = _ops._Setup(row, torch.device("cpu"))
    optimizer = _ops.make_optimizer(setup.params, row)
    scaler = make()
    _ops.force_device_decision(scaler)
    scaler.scale(torch.ones(()))

    def iteration() -> None:
        scaler.scale(setup.loss)
        scaler.step(optimizer)
        scaler.update()

    counter = functools.partial(count_ops, host_only=True)
    counted, plain = _ops._steady_state(setup, iteration, optimizer.step, counter)
    return _ops.own_per_iteration(counted, [plain])["kernels"]


def seconds(make, steps: int = 300) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    x = torch.randn(64, 256)
    guard = make() if make else None
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        loss = model(x).square().mean()
        if guard is None:
            loss.backward()
            opt.step()
        else:
            guard.scale(loss).backward()
            guard.step(opt)
            guard.update()
    return time.perf_counter() - t0


def main() -> None:
    print("ops per iteration (device-side decision path, optimizer's own ops subtracted)")
    for row in _ops.rows():
        counts = "  ".join(f"{name} {ops(row, make):g}" for name, make in ARMS.items())
        print(f"  {row.name:18s} {counts}")
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {"plain": []}
    for _ in range(5):
        times["plain"].append(seconds(None))
        for name, make in ARMS.items():
            times.setdefault(name, []).append(seconds(make))
    base = statistics.median(times["plain"])
    print("CPU time per step relative to plain AdamW (median of 5, 1 thread)")
    for name, values in times.items():
        print(f"  {name:26s} {statistics.median(values) / base:.3f}")


if __name__ == "__main__":
    main()
