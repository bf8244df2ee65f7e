"""The benchmark statistics: ratio intervals from paired repetitions, verdicts, noise check."""

from __future__ import annotations

import math
import random

import pytest

from dscale.bench._stats import QUIET_BAND, compare, noise, ratio_interval, verdict


def _noisy(n: int, seed: int, spread: float) -> list[float]:
    """Per-repetition overheads whose load varies a lot from one repetition to the next."""
    rng = random.Random(seed)
    return [100.0 * (1 + spread * rng.random()) for _ in range(n)]


def test_pairing_keeps_a_small_true_difference_visible_under_large_shared_noise() -> None:
    den = _noisy(40, seed=1, spread=3.0)  # the load moves both arms alike, by up to 4x
    num = [1.05 * d for d in den]
    paired = ratio_interval(num, den)
    assert paired["verdict"] == "higher"
    assert paired["low"] == pytest.approx(1.05) and paired["high"] == pytest.approx(1.05)
    # Unpaired (the same values, shuffled apart), the noise hides the 5%: the interval holds 1.
    shuffled = random.Random(7).sample(num, len(num))
    assert ratio_interval(shuffled, den)["verdict"] == "no difference"


def test_an_arm_against_an_independent_copy_of_itself_is_no_difference() -> None:
    rng = random.Random(3)
    base = [100.0 + rng.gauss(0, 5) for _ in range(60)]
    copy = [100.0 + rng.gauss(0, 5) for _ in range(60)]
    result = ratio_interval(copy, base)
    assert result["low"] < 1 < result["high"]
    assert result["verdict"] == "no difference"
    assert QUIET_BAND[0] <= result["low"] and result["high"] <= QUIET_BAND[1]
    assert noise(result).startswith("quiet enough")


def test_a_clear_speedup_is_called_lower_and_the_estimate_is_the_ratio_of_medians() -> None:
    den = _noisy(30, seed=2, spread=0.2)
    num = [0.5 * d + 1.0 for d in den]
    result = ratio_interval(num, den)
    assert result["verdict"] == "lower" and result["high"] < 1
    ordered = sorted(range(30), key=lambda i: den[i])
    median_den = (den[ordered[14]] + den[ordered[15]]) / 2
    assert result["estimate"] == pytest.approx((0.5 * median_den + 1.0) / median_den)


def test_overheads_at_or_below_zero_give_no_ratio_rather_than_a_false_result() -> None:
    result = ratio_interval([-1.0, -2.0, 0.5], [3.0, 4.0, 5.0])
    assert math.isnan(result["estimate"]) and result["verdict"] == "n/a"
    assert noise(result).startswith("too noisy")


def test_the_interval_is_reproducible() -> None:
    den = _noisy(25, seed=4, spread=1.0)
    num = _noisy(25, seed=5, spread=1.0)
    assert ratio_interval(num, den) == ratio_interval(num, den)


def test_a_wide_aa_interval_says_the_run_is_too_noisy() -> None:
    wide = {"estimate": 1.0, "low": 0.8, "high": 1.3, "verdict": "no difference"}
    assert noise(wide).startswith("too noisy to conclude on differences under about 30%")
    assert noise(None) == "no A/A arm"


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [(0.5, 0.9, "lower"), (1.1, 2.0, "higher"), (0.9, 1.1, "no difference"),
     (math.nan, 1.0, "n/a")],
)  # fmt: skip
def test_verdict(low: float, high: float, expected: str) -> None:
    assert verdict(low, high) == expected


def test_compare_takes_only_pairs_whose_arms_ran_and_rejects_unpaired_lengths() -> None:
    arms = {n: {"paired_overheads_us": [1.0, 2.0, 3.0]} for n in ("a", "b")}
    assert set(compare(arms, [("a", "b"), ("a", "missing")])) == {"a/b"}
    with pytest.raises(ValueError, match="equal, non-zero length"):
        ratio_interval([1.0], [1.0, 2.0])
