"""Interleaved timing of benchmark arms, and the summary statistics reported for them.

Each repetition runs every arm once. The orders come from a Williams design: over one cycle of
orders every arm runs in every position, and right after every other arm, equally often (the same
on every rank). With large tensors an arm bills its successor for the cache and allocator state it
leaves behind: a fixed rotation (each arm always after the same one) put an A/A pair 1.7x apart,
and seeded random orders, which repeat across runs, kept a 1.3x bias on one arm run after run.
An arm's ``prepare`` (restoring gradients) runs untimed right before its timed ``run``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Arm:
    """One contender: ``prepare`` runs untimed, then ``run`` is timed."""

    name: str
    run: Callable[[], object]
    prepare: Callable[[], object] | None = None


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn`` takes; on CUDA the queue is drained before and after, so GPU work counts."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def run_interleaved(
    arms: list[Arm], reps: int, device: torch.device, warmup: int = 2
) -> dict[str, list[float]]:
    """Time every arm ``reps`` times, interleaved; returns seconds per arm (warm-up dropped)."""
    times: dict[str, list[float]] = {arm.name: [] for arm in arms}
    orders = balanced_orders(len(arms))
    for rep in range(warmup + reps):
        for index in orders[(rep - warmup) % len(orders)]:  # measured reps start a cycle
            arm = arms[index]
            if arm.prepare is not None:
                arm.prepare()
            elapsed = time_once(arm.run, device)
            if rep >= warmup:
                times[arm.name].append(elapsed)
    return times


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` arms in which each arm follows each other arm equally often (Williams).

    ``n`` orders for an even ``n``, ``2n`` (each also reversed) for an odd one. Run reps in
    multiples of their number for an exact balance.
    """
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(arm + shift) % n for arm in first] for shift in range(n)]
    return orders if n % 2 == 0 else orders + [order[::-1] for order in orders]


def summarize(times: dict[str, list[float]], baseline: str) -> dict[str, dict[str, Any]]:
    """Per arm: median and min time, and the overhead over ``baseline`` (in microseconds).

    ``paired_overheads_us`` holds the per-repetition differences (paired: both ran in the same
    repetition, under the same load), which the ratio intervals resample; ``overhead_median_us``
    is their median; ``overhead_min_us`` is min(arm) - min(baseline), the least disturbed estimate.
    """
    base = times[baseline]
    out: dict[str, dict[str, Any]] = {}
    for name, values in times.items():
        paired = [a - b for a, b in zip(values, base)]
        out[name] = {
            "median_us": statistics.median(values) * 1e6,
            "min_us": min(values) * 1e6,
            "overhead_median_us": statistics.median(paired) * 1e6,
            "overhead_min_us": (min(values) - min(base)) * 1e6,
            "times_us": [t * 1e6 for t in values],
            "paired_overheads_us": [d * 1e6 for d in paired],
            "reps": len(values),
        }
    return out
