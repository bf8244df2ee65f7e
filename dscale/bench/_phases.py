"""Where a scaler's overhead goes: unscale_(), step() and update() timed separately.

The step-overhead tables say how much a scaler costs; this says which call to look at. Scalers
are interleaved within each repetition, on the same gradients restored before each one.
"""

from __future__ import annotations

import statistics
from functools import partial
from typing import Any

import torch

from dscale.bench._arms import SCALERS, make_optimizer, make_scaler
from dscale.bench._single import Grads
from dscale.bench._timing import time_once

PHASES = ("unscale_", "step", "update")


def phases(
    count: int, numel: int, reps: int, device: torch.device, warmup: int = 2
) -> dict[str, Any]:
    """Median and min microseconds of each phase, per scaler (SGD foreach)."""
    grads = Grads(count, numel, device)
    opt = make_optimizer(grads.params, "sgd", "foreach")  # one, as in the step tables
    arms = [(name, make_scaler(name, device), opt) for name in SCALERS]
    times: dict[str, dict[str, list[float]]] = {n: {p: [] for p in PHASES} for n in SCALERS}
    for rep in range(warmup + reps):
        shift = rep % len(arms)
        for name, scaler, opt in arms[shift:] + arms[:shift]:
            grads.restore()
            calls = (partial(scaler.unscale_, opt), partial(scaler.step, opt), scaler.update)
            for phase, call in zip(PHASES, calls):
                elapsed = time_once(call, device)
                if rep >= warmup:
                    times[name][phase].append(elapsed)
    summary = {
        name: {
            phase: {
                "median_us": statistics.median(values) * 1e6,
                "min_us": min(values) * 1e6,
            }
            for phase, values in per_phase.items()
        }
        for name, per_phase in times.items()
    }
    return {"count": count, "numel": numel, "bytes": grads.nbytes, "scalers": summary}
