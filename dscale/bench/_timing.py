"""Interleaved timing of benchmark arms, and the summary statistics reported for them.

Each repetition runs every arm once, in a fresh random order (the same on every rank: seeded by the
repetition), so that no arm always runs first, last, or right after the same other arm. A fixed
rotation keeps each arm's predecessor: with large tensors the allocator and cache state an arm
leaves behind then bill its successor, and an A/A pair came out 1.7x apart. An arm's ``prepare``
(restoring gradients) runs untimed right before its timed ``run``.
"""

from __future__ import annotations

import random
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
    for rep in range(warmup + reps):
        order = list(arms)
        random.Random(rep).shuffle(order)
        for arm in order:
            if arm.prepare is not None:
                arm.prepare()
            elapsed = time_once(arm.run, device)
            if rep >= warmup:
                times[arm.name].append(elapsed)
    return times


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
