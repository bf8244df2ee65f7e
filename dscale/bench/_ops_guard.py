"""``python -m dscale.bench ops``: the StepGuard rows, with and without the spike gate.

A StepGuard (bf16/fp32: scale pinned at 1) runs the same device-side decision as the scaler rows
(``_ops.force_device_decision``); the gate watches the loss and the grad norm, at its default
window (128) and at a long one (1024), to show that the count does not depend on the window's
length. Counted as the other rows: ``scale`` + ``step`` + ``update`` minus the plain step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

import dscale
from dscale.bench import _ops
from dscale.bench._op_count import count_ops

GUARD_ARMS = ("guard", "gate", "gate_w1024")
#: Issue 34's target: the gate adds at most this many ops to the guard's.
GATE_EXTRA_OPS = 10


def make_guard(arm: str, device: torch.device) -> dscale.StepGuard:
    """A StepGuard by arm name on the device-side decision path."""
    gate: dict[str, Any] = {}
    if arm != "guard":
        window = 1024 if arm == "gate_w1024" else 128
        gate = {"spike_signals": ("loss", "grad_norm"), "spike_window": window}
    guard = dscale.StepGuard(device.type, **gate)
    _ops.force_device_decision(guard)
    return guard


def measure_guard(arm: str, row: _ops.Row, device: torch.device) -> dict[str, Any]:
    """The guard's own ops per iteration for ``arm`` on ``row``."""
    setup = _ops._Setup(row, device)
    optimizer = _ops.make_optimizer(setup.params, row)
    guard = make_guard(arm, device)

    def iteration() -> None:
        guard.scale(setup.loss)
        guard.step(optimizer)
        guard.update()

    counter: Callable[[Callable[[], object]], Any] = functools.partial(
        count_ops, host_only=device.type == "cpu"
    )
    counted, plain = _ops._steady_state(setup, iteration, optimizer.step, counter)
    return _ops.own_per_iteration(counted, [plain])


def run_guard(device: torch.device) -> dict[str, Any]:
    """Every row with every guard arm, in this process (one CPU thread: the counts are the same,
    and a loaded machine runs the CPU's fused optimizers ten times faster so)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {
            row.name: {arm: measure_guard(arm, row, device) for arm in GUARD_ARMS}
            for row in _ops.rows()
        }
    finally:
        torch.set_num_threads(threads)


def check_guard_targets(table: dict[str, Any]) -> list[dict[str, Any]]:
    """gate <= guard + GATE_EXTRA_OPS; neither grows with the parameters nor with the window."""
    checks: list[dict[str, Any]] = []
    by_shape: dict[str, dict[int, dict[str, Any]]] = {}
    for name, arms in table.items():
        optimizer, impl, count = name.split()
        by_shape.setdefault(f"{optimizer} {impl}", {})[int(count[1:])] = arms
        guard, gate = arms["guard"]["kernels"], arms["gate"]["kernels"]
        checks.append(
            {
                "target": f"{name}: gate <= guard + {GATE_EXTRA_OPS}",
                "ok": gate <= guard + GATE_EXTRA_OPS,
                "detail": f"gate {gate:g} ops, guard {guard:g} (+{gate - guard:g})",
            }
        )
        long_window = arms["gate_w1024"]["kernels"]
        checks.append(
            {
                "target": f"{name}: gate independent of the window",
                "ok": long_window == gate,
                "detail": f"window 128: {gate:g}, window 1024: {long_window:g}",
            }
        )
    for shape, counts in by_shape.items():
        for arm in GUARD_ARMS:
            values = {n: counts[n][arm]["kernels"] for n in sorted(counts)}
            checks.append(
                {
                    "target": f"{shape}: {arm} independent of the parameter count",
                    "ok": len(set(values.values())) == 1,
                    "detail": ", ".join(f"x{n}: {v:g}" for n, v in values.items()),
                }
            )
    return checks
