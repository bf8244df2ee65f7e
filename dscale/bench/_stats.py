"""How far a ratio of overheads can be trusted: a bootstrap interval, a verdict and a noise check.

Every repetition ran all arms back to back, so an arm's overhead in a repetition (its time minus
the plain step's time in the same repetition) is paired with every other arm's. A ratio of two
arms is the ratio of their median paired overheads; its interval comes from a percentile
bootstrap that resamples whole repetitions (keeping the pairs together), with a fixed seed so
the same numbers give the same interval. A ratio is called a difference only when its interval
excludes 1. The A/A arm (a peer against a second copy of itself) shows how wide an interval
plain noise makes in this run.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from typing import Any

LEVEL = 0.95
RESAMPLES = 2000
# The A/A interval must lie inside this band for the run to tell differences of about 10% apart.
QUIET_BAND = (0.9, 1.1)
# Resamples whose median overhead is <= 0 have no ratio; past this share the interval is n/a.
MAX_UNDEFINED = 0.025
METHOD = (
    f"ratio of median paired overheads; {LEVEL:.0%} percentile bootstrap over repetitions "
    f"({RESAMPLES} resamples)"
)


def _ratio_of_medians(num: Sequence[float], den: Sequence[float]) -> float:
    top, bottom = statistics.median(num), statistics.median(den)
    return top / bottom if top > 0 and bottom > 0 else math.nan


def ratio_interval(
    num: Sequence[float], den: Sequence[float], *, seed: int = 0
) -> dict[str, float | str]:
    """The ratio median(num) / median(den) of paired overheads, with its bootstrap interval.

    ``num[i]`` and ``den[i]`` are the two arms' overheads in repetition ``i``. Returns
    ``estimate``, ``low``, ``high`` (NaN where undefined: an overhead at or below zero is below
    the noise, and a ratio with it would read as a result when it is none) and ``verdict``.
    """
    if len(num) != len(den) or not num:
        raise ValueError(
            f"need paired overheads of equal, non-zero length, got {len(num)}, {len(den)}"
        )
    estimate = _ratio_of_medians(num, den)
    rng = random.Random(seed)
    n = len(num)
    samples = []
    for _ in range(RESAMPLES):
        picks = [rng.randrange(n) for _ in range(n)]
        samples.append(_ratio_of_medians([num[i] for i in picks], [den[i] for i in picks]))
    defined = sorted(s for s in samples if not math.isnan(s))
    low = high = math.nan
    if len(defined) >= (1 - MAX_UNDEFINED) * RESAMPLES and not math.isnan(estimate):
        tail = (1 - LEVEL) / 2
        low = defined[int(tail * (len(defined) - 1))]
        high = defined[math.ceil((1 - tail) * (len(defined) - 1))]
    return {"estimate": estimate, "low": low, "high": high, "verdict": verdict(low, high)}


def verdict(low: float, high: float) -> str:
    """``lower`` or ``higher`` when the interval excludes 1, ``no difference`` when it holds 1."""
    if math.isnan(low) or math.isnan(high):
        return "n/a"
    if high < 1:
        return "lower"
    if low > 1:
        return "higher"
    return "no difference"


def compare(
    arms: dict[str, dict[str, Any]], pairs: Sequence[tuple[str, str]]
) -> dict[str, dict[str, float | str]]:
    """Ratio intervals for each ``(numerator, denominator)`` arm pair present in ``arms``."""
    return {
        f"{num}/{den}": ratio_interval(
            arms[num]["paired_overheads_us"], arms[den]["paired_overheads_us"]
        )
        for num, den in pairs
        if num in arms and den in arms
    }


def noise(aa: dict[str, float | str] | None) -> str:
    """Whether this run's A/A interval is narrow enough to conclude on differences of ~10%."""
    if aa is None:
        return "no A/A arm"
    low, high = float(aa["low"]), float(aa["high"])
    if math.isnan(low) or math.isnan(high):
        return "too noisy: the A/A ratio has no interval (overheads at or below the noise)"
    if QUIET_BAND[0] <= low and high <= QUIET_BAND[1]:
        return "quiet enough: the A/A interval lies within 0.9-1.1"
    return (
        f"too noisy to conclude on differences under about {max(1 - low, high - 1):.0%}: "
        f"the A/A interval [{low:.2f}, {high:.2f}] reaches outside 0.9-1.1"
    )
