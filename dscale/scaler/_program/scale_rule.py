"""The scale update rule: tensor ops on the device, or host arithmetic when decisions are known.

torch's rule (back off on every overflow, grow after ``growth_interval`` clean steps, never grow to
inf) is the default. dscale adds clamping to ``[min_scale, max_scale]`` and hysteresis: a number of
overflows tolerated before backing off, refilled either when the scale grows (Megatron, DeepSpeed's
default) or by every clean step (DeepSpeed's ``consecutive_hysteresis``). Overflowing steps are
skipped either way; hysteresis only delays the back-off.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Literal

import torch

HysteresisRefill = Literal["on_growth", "on_clean_step"]

#: The five event counters, in their order in the int64 counters vector. The one place they are
#: named: GradScaler.counters()/snapshot(), the state dict and the metrics all use these names.
COUNTER_NAMES = ("steps", "skipped_steps", "skipped_in_a_row", "growths", "backoffs")
STEPS, SKIPPED, SKIPPED_IN_A_ROW, GROWTHS, BACKOFFS = range(len(COUNTER_NAMES))
NUM_COUNTERS = len(COUNTER_NAMES)


@dataclass(frozen=True)
class ScalePolicy:
    """The constants of the update rule; validated by GradScaler before one is built."""

    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: float | None
    max_scale: float | None
    hysteresis: int
    hysteresis_refill: HysteresisRefill


def _times(scale: torch.Tensor, factor: float) -> torch.Tensor:
    # fp64 product rounded once to fp32: the same float torch's _amp_update_scale_ kernel computes.
    return (scale.double() * factor).float()


def update_(
    policy: ScalePolicy,
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
) -> None:
    """Apply one iteration's outcome to the scale and both trackers, in place on the device.

    ``found_inf`` is the agreed flag of the iteration (> 0: an optimizer overflowed on some rank).
    The event counters are not touched: ``state_buffer`` derives them from its log of updates.
    torch's own rule (:func:`is_torch_rule`) runs as torch's ``_amp_update_scale_`` instead.
    """
    found = found_inf > 0
    clean = ~found

    tracker = torch.where(found, 0, growth_tracker + 1)
    # >= rather than torch's ==: a growth_interval lowered mid-run must still let the scale grow.
    due = tracker >= policy.growth_interval  # never on an overflow: the tracker is 0 there
    grown = _times(scale, policy.growth_factor)
    if policy.max_scale is not None:
        grown = grown.clamp(max=policy.max_scale)
    grows = due & torch.isfinite(grown) & (grown > scale)

    hyst = torch.where(found, (hysteresis_tracker - 1).clamp(min=0), hysteresis_tracker)
    backs_off = found & (hyst <= 0)
    shrunk = _times(scale, policy.backoff_factor)
    if policy.min_scale is not None:
        shrunk = shrunk.clamp(min=policy.min_scale)
    refill = clean if policy.hysteresis_refill == "on_clean_step" else due
    hysteresis_tracker.copy_(torch.where(refill, policy.hysteresis, hyst))
    growth_tracker.copy_(torch.where(due, 0, tracker))
    scale.copy_(torch.where(backs_off, shrunk, torch.where(grows, grown, scale)))


def torch_rule_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    """torch's ``_amp_update_scale_`` as pointwise ops (Inductor does not lower the kernel; these
    it fuses): the same scale and tracker bit for bit, its products in fp64 rounded once."""
    found = found_inf != 0
    successful = growth_tracker + 1
    due = ~found & (successful == growth_interval)
    grown = _times(scale, growth_factor)
    keep = torch.where(due & torch.isfinite(grown), grown, scale)
    scale.copy_(torch.where(found, _times(scale, backoff_factor), keep))
    growth_tracker.copy_(torch.where(found | due, 0, successful))


def is_torch_rule(policy: ScalePolicy) -> bool:
    """torch's own rule: no clamp, back off on every overflow (then torch's kernel applies)."""
    return policy.min_scale is None and policy.max_scale is None and policy.hysteresis == 1


_F32 = struct.Struct("f")


def f32(value: float) -> float:
    """``value`` rounded to float32, as a Python float (inf where float32 overflows)."""
    try:
        return float(_F32.unpack(_F32.pack(value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


@dataclass(frozen=True)
class HostState:
    """The scaler's state as Python numbers: the authority while every decision is host-known.

    A plain optimizer step already reads the agreed flag on the host to decide the skip, so the
    update that follows can be plain arithmetic instead of a dozen tiny device ops. Replaced
    whole on every update, so a reader in another thread always sees one consistent state.
    """

    scale: float
    growth_tracker: int
    hysteresis_tracker: int
    counters: tuple[int, ...]


def next_host_state(policy: ScalePolicy, s: HostState, found: bool) -> HostState:
    """The same rule as :func:`update_`, on the host; tests hold the two to identical results."""
    steps, skipped, in_a_row, growths, backoffs = s.counters
    scale, hyst = s.scale, s.hysteresis_tracker
    if found:
        tracker = 0
        hyst = max(hyst - 1, 0)
        if hyst <= 0:
            shrunk = f32(scale * policy.backoff_factor)
            if policy.min_scale is not None:
                shrunk = max(shrunk, f32(policy.min_scale))
            backoffs += shrunk < scale
            scale = shrunk
        return HostState(
            scale, tracker, hyst, (steps + 1, skipped + 1, in_a_row + 1, growths, backoffs)
        )
    tracker = s.growth_tracker + 1
    if tracker >= policy.growth_interval:
        tracker = 0
        grown = f32(scale * policy.growth_factor)
        if policy.max_scale is not None:
            grown = min(grown, f32(policy.max_scale))
        if math.isfinite(grown) and grown > scale:
            growths += 1
            scale = grown
        hyst = policy.hysteresis
    if policy.hysteresis_refill == "on_clean_step":
        hyst = policy.hysteresis
    return HostState(scale, tracker, hyst, (steps + 1, skipped, 0, growths, backoffs))
