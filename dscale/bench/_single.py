"""Single-process scenarios: the scalers' step overhead on pre-populated scaled gradients.

All arms share the parameters, the saved scaled gradients and one optimizer, so every arm steps
the same state buffers: with an optimizer (and buffers) per arm, where in memory each arm's
buffers landed showed up as a difference between the arms on few large tensors. Before every
timed run the gradients are copied back from the saved scaled copy (untimed), so every
repetition checks and unscales the same values; the tiny learning rate keeps repeated steps
finite.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from dscale.bench._arms import (
    DEVICE_PATH_ARMS,
    FLOOR,
    INIT_SCALE,
    UNSCALE_SUFFIX,
    make_optimizer,
    make_scaler,
    scaler_step,
)
from dscale.bench._stats import compare, ratio_interval
from dscale.bench._syncs import count_host_syncs
from dscale.bench._timing import Arm, run_interleaved, summarize
from dscale.scaler._program.unscale import check_and_unscale_, group_by_device_and_dtype

# Single process: dscale against both peers, and torch's scaler against itself (the A/A arm).
# The floor arm says how far below torch any scaler keeping torch's numbers could go.
ARMS = ("dscale", "torch", "torch_aa", "sharded", FLOOR)
PAIRS = (("dscale", "torch"), ("dscale", "sharded"), ("torch_aa", "torch"), (FLOOR, "torch"))


class Grads:
    """``count`` parameters of ``numel`` floats with scaled grads, and their saved copy."""

    def __init__(self, count: int, numel: int, device: torch.device, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.params = [
            torch.nn.Parameter(torch.randn(numel, generator=gen).to(device)) for _ in range(count)
        ]
        self.saved = [
            torch.randn(numel, generator=gen).to(device) * INIT_SCALE for _ in range(count)
        ]
        self.grads = [saved.clone() for saved in self.saved]
        for param, grad in zip(self.params, self.grads):
            param.grad = grad
        self.nbytes = sum(g.numel() * g.element_size() for g in self.saved)

    def restore(self) -> None:
        """Put the saved scaled values back into the grads (in place: the optimizers hold them)."""
        torch._foreach_copy_(self.grads, self.saved)


def step_arms(
    grads: Grads, optimizer: str, impl: str, device: torch.device, scalers: tuple[str, ...]
) -> list[Arm]:
    """The plain optimizer step and one scaler arm per name in ``scalers``, on one optimizer."""
    opt = make_optimizer(grads.params, optimizer, impl)
    arms = [Arm("plain", opt.step, grads.restore)]
    for name in scalers:
        run = scaler_step(
            make_scaler(name, device), opt, unscale_first=name.endswith(UNSCALE_SUFFIX)
        )
        arms.append(Arm(name, run, grads.restore))
    return arms


def host_syncs(arms: list[Arm], device: torch.device) -> dict[str, int]:
    """Host syncs of one run of each arm (CUDA only; empty on the CPU)."""
    if device.type != "cuda":
        return {}
    out = {}
    for arm in arms:
        if arm.prepare is not None:
            arm.prepare()
        out[arm.name] = count_host_syncs(arm.run)
    return out


def step_overhead(
    count: int,
    numel: int,
    optimizer: str,
    impl: str,
    reps: int,
    device: torch.device,
    scalers: tuple[str, ...] = ARMS,
    pairs: tuple[tuple[str, str], ...] = PAIRS,
) -> dict[str, Any]:
    """One scenario: per-arm overhead over the plain step, ratio intervals, host syncs on CUDA."""
    grads = Grads(count, numel, device)
    arms = step_arms(grads, optimizer, impl, device, scalers)
    result = summarize(run_interleaved(arms, reps, device), "plain")
    return {
        "count": count,
        "numel": numel,
        "bytes": grads.nbytes,
        "optimizer": optimizer,
        "impl": impl,
        "arms": result,
        "ratios": compare(result, pairs),
        "host_syncs": host_syncs(arms, device),
    }


# Device path: few small tensors, where each launch (dispatch) is the cost, at two counts.
DEVICE_PATH_ROWS = ((8, 4096, "adamw"), (200, 4096, "adamw"))
DEVICE_PATH_SCALERS = (*DEVICE_PATH_ARMS, "torch", "torch_aa")
DEVICE_PATH_PAIRS = (
    *((name, "torch") for name in DEVICE_PATH_ARMS),
    ("torch_aa", "torch"),
    # What predictive costs over the dynamic rule on the same path (issue 34: <= 1.5 on the CPU).
    ("dscale_predictive", "dscale_device"),
)


def device_path(reps: int, device: torch.device) -> list[dict[str, Any]]:
    """dscale's device-side decision (plain, sync_free, predictive) against torch's scaler."""
    return [
        step_overhead(
            count, numel, "adam", impl, reps, device, DEVICE_PATH_SCALERS, DEVICE_PATH_PAIRS
        )
        for count, numel, _ in DEVICE_PATH_ROWS
        for impl in ("fused", "foreach")
    ]


def unscale_pass(count: int, numel: int, reps: int, device: torch.device) -> dict[str, Any]:
    """dscale's check-and-unscale pass against a plain ``_foreach_mul_`` (the bandwidth floor).

    Each pass reads and writes every grad once; ``gb_per_s`` is those bytes over the median time,
    and a plain device copy of the same bytes (``copy``) says what the memory can do.
    """
    grads = Grads(count, numel, device)
    inv = torch.full((), 1.0 / INIT_SCALE, device=device)
    flat = torch.empty(sum(g.numel() for g in grads.grads), device=device)
    source = torch.ones_like(flat)

    def dscale_pass() -> None:
        found = torch.zeros((), device=device)
        check_and_unscale_(group_by_device_and_dtype(grads.grads), inv, found)

    arms = [
        Arm("foreach_mul", lambda: torch._foreach_mul_(grads.grads, inv), grads.restore),
        Arm("dscale_unscale", dscale_pass, grads.restore),
        Arm("copy", lambda: flat.copy_(source), grads.restore),
    ]
    result = summarize(run_interleaved(arms, reps, device), "foreach_mul")
    time_ratio = ratio_interval(
        result["dscale_unscale"]["times_us"], result["foreach_mul"]["times_us"]
    )
    moved = 2 * grads.nbytes  # read and written
    return {
        "count": count,
        "numel": numel,
        "bytes": grads.nbytes,
        "arms": result,
        "ratios": {"dscale_unscale/foreach_mul": time_ratio},
        "gb_per_s": {
            name: moved / (result[name]["median_us"] * 1e-6) / 1e9
            for name in ("foreach_mul", "dscale_unscale", "copy")
        },
    }


def _slope(xs: list[float], ys: list[float]) -> float:
    return statistics.linear_regression(xs, ys).slope if len(set(xs)) > 1 else float("nan")


def sweep(
    counts: list[int],
    numel_for_count: int,
    numels: list[int],
    count_for_numel: int,
    reps: int,
    device: torch.device,
) -> dict[str, Any]:
    """How the overhead grows with the number of tensors, and with the bytes (SGD foreach)."""
    scalers, pairs = ("dscale", "torch"), (("dscale", "torch"),)
    by_count = [
        step_overhead(c, numel_for_count, "sgd", "foreach", reps, device, scalers, pairs)
        for c in counts
    ]
    by_bytes = [
        step_overhead(count_for_numel, n, "sgd", "foreach", reps, device, scalers, pairs)
        for n in numels
    ]
    slopes: dict[str, dict[str, float]] = {}
    for name in scalers:
        slopes[name] = {
            "us_per_tensor": _slope(
                [float(p["count"]) for p in by_count],
                [p["arms"][name]["overhead_median_us"] for p in by_count],
            ),
            "us_per_mib": _slope(
                [p["bytes"] / 2**20 for p in by_bytes],
                [p["arms"][name]["overhead_median_us"] for p in by_bytes],
            ),
        }
    return {"by_count": by_count, "by_bytes": by_bytes, "slopes": slopes}
