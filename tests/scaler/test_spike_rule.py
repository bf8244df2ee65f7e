"""The spike gate's rule, held against OLMo-core's published rule on a recorded loss series.

The series (``data/loss_series.txt``) is the loss and grad norm of 400 steps of the launcher's
demo model (``data/record_loss_series.py`` records it). Spikes are multiplied into chosen steps.
The reference below is OLMo-core's ``SkipStepOptimizer.get_step_factor``
(allenai/OLMo-core, ``src/olmo_core/optim/skip_step_optimizer.py``), written out in plain Python:

- the window is the previous ``rolling_interval_length`` values (it keeps one more, the current);
- mean and standard deviation by ``torch.std_mean`` (the sample std, n - 1);
- a step is skipped when ``|value - mean| / std > sigma_factor`` for the loss or the grad norm;
- no skip while the list, the current value included, is shorter than ``max(20, length // 2)``;
- every value enters the window, skipped or not.

dscale deviates on two points on purpose (``docs/step-guard.md``): one-sided (only values above
the mean skip, as Levanter), and only applied steps enter the window. Its warm-up counts the values
already in the window (Levanter's count), so OLMo-core's 64 is dscale's 63.
"""

from __future__ import annotations

import statistics
import struct
from pathlib import Path

import pytest
import torch

import dscale
from tests.scaler._setup import decide_on_device

SERIES = Path(__file__).parent / "data" / "loss_series.txt"


def _recorded() -> tuple[list[float], list[float]]:
    rows = [line.split() for line in SERIES.read_text().splitlines() if not line.startswith("#")]
    return [float(r[1]) for r in rows], [float(r[2]) for r in rows]


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def reference(
    losses: list[float],
    grad_norms: list[float],
    *,
    sigma: float = 6.0,
    length: int = 128,
    min_previous: int = 63,  # OLMo-core: len(losses) < max(20, length // 2), current included
    two_sided: bool = True,
    keep_skipped: bool = True,
) -> tuple[list[int], float]:
    """The steps OLMo-core's rule skips (defaults: as published); also the smallest margin
    |z - sigma| seen, so a test can show that float rounding cannot flip a decision."""
    windows: list[list[float]] = [[], []]
    skipped, margin = [], float("inf")
    for step, values in enumerate(zip(losses, grad_norms, strict=True)):
        skip = False
        if len(windows[0]) >= min_previous:
            for window, value in zip(windows, values, strict=True):
                mean, std = statistics.fmean(window), statistics.stdev(window)
                z = (value - mean) / std
                z = abs(z) if two_sided else z
                margin = min(margin, abs(z - sigma))
                skip |= z > sigma
        if skip:
            skipped.append(step)
        if keep_skipped or not skip:
            for window, value in zip(windows, values, strict=True):
                window.append(value)
                del window[:-length]
    return skipped, margin


def dscale_skips(
    losses: list[float], grad_norms: list[float], *, on_device: bool, **gate: object
) -> list[int]:
    """Drive a StepGuard with a one-parameter model whose loss and grad norm are the series'."""
    guard = dscale.StepGuard(
        "cpu", sync_free=on_device, spike_signals=("loss", "grad_norm"), **gate
    )
    if on_device:
        decide_on_device(guard)
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0, momentum=0.9)
    skipped = []
    for step, (loss, norm) in enumerate(zip(losses, grad_norms, strict=True)):
        opt.zero_grad()
        guard.scale(torch.tensor(loss) + norm * p.sum()).backward()  # value loss, grad norm
        guard.step(opt)
        if not guard.step_applied():
            skipped.append(step)
        guard.update()
    snap = guard.snapshot()
    assert snap["spike_skipped_steps"] == len(skipped) and snap["skipped_steps"] == 0
    return skipped


def _spiked(spikes: dict[int, tuple[float, float]]) -> tuple[list[float], list[float]]:
    losses, norms = _recorded()
    for step, (loss_factor, norm_factor) in spikes.items():
        losses[step] *= loss_factor
        norms[step] *= norm_factor
    # What the gate receives: float32 losses and norms.
    return [_f32(x) for x in losses], [_f32(x) for x in norms]


PATHS = pytest.mark.parametrize("on_device", [False, True], ids=["host", "sync_free_on_device"])


@PATHS
def test_isolated_spikes_are_skipped_exactly_where_olmo_core_skips_them(on_device: bool) -> None:
    # Spikes more than a window apart, and no sudden drop: where dscale's choices cannot matter.
    losses, norms = _spiked({200: (3.0, 1.0), 340: (1.0, 20.0)})
    published, margin = reference(losses, norms)
    assert published == [200, 340]
    assert margin > 1e-3  # no decision sits on the threshold
    assert dscale_skips(losses, norms, on_device=on_device, spike_warmup=63) == published
    assert dscale_skips(losses, norms, on_device=on_device) == published  # default warm-up 64


@PATHS
def test_a_second_spike_and_a_drop_show_the_two_documented_deviations(on_device: bool) -> None:
    # 203: a smaller spike right after 200's; 380: the loss falls to a tenth for one step.
    losses, norms = _spiked({200: (3.0, 1.0), 203: (2.0, 1.0), 380: (0.1, 1.0), 330: (1.0, 20.0)})
    ours, margin = reference(losses, norms, min_previous=64, two_sided=False, keep_skipped=False)
    published, _ = reference(losses, norms)
    assert margin > 1e-3
    assert ours == [200, 203, 330]
    # OLMo-core: 200's value widened the band, so 203 lands; the drop at 380 is skipped.
    assert published == [200, 330, 380]
    assert dscale_skips(losses, norms, on_device=on_device) == ours


def test_no_step_is_skipped_before_the_warm_up_whatever_the_value() -> None:
    losses, norms = _spiked({30: (100.0, 100.0)})
    assert dscale_skips(losses, norms, on_device=False) == []  # 30 values in: too early
    losses, norms = _spiked({70: (100.0, 1.0)})
    assert dscale_skips(losses, norms, on_device=False) == [70]
    assert dscale_skips(losses, norms, on_device=False, spike_warmup=80) == []
