"""``policy="predictive"``: set the scale from the measured gradient range instead of searching.

Every rank measures the largest finite gradient magnitude of the step (``_grad_measure``); the
value rides on the step's one MAX all-reduce, so every rank computes the same next scale here.

The rule, after the reactive (dynamic) rule of ``_policy`` has run:

* **Overflow:** the dynamic rule stands: the step is skipped and the scale backs off (with
  hysteresis and ``min_scale``). When it backs off, the safety margin doubles
  (``margin_log2 += 1``, at most ``MAX_MARGIN_LOG2``): the gradients inside the backward pass ran
  higher, relative to the parameter gradients we measure, than the margin allowed for.
* **Clean step:** the target is the largest power of two ``2**t`` with
  ``grad_max_abs * 2**margin_log2 * 2**t <= 65504`` (fp16's largest finite value), clamped to
  ``[min_scale, max_scale]``. The scale moves toward it with these limits:

  - *down at once:* a lower scale never overflows; waiting would risk a skipped step.
  - *up by at most one power of two per step, and only after the target has stayed above the
    scale for* ``RISE_AFTER`` *clean steps in a row:* one batch with unusually small gradients
    must not lift the scale by several powers of two that the next ordinary batch overflows.
  - *the first measurement jumps:* a new scaler runs its first step at ``min(init_scale, 1.0)``
    (scaling cannot overflow there) and its first clean, measured step sets the target directly.
  - *the margin relaxes slowly:* after ``growth_interval`` clean steps in a row (where the dynamic
    rule would grow the scale) the margin halves, down to ``MIN_MARGIN_LOG2``: the same rate at
    which the dynamic rule probes upward, so the predictive rule overflows no more often.

Growth and back-off counters count every rise and fall of the scale.

Both forms below (host arithmetic, device tensor ops) compute bit-identical results; the target is
computed from the exact binary exponent (``frexp``), never from a rounded ``log2``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from dscale._policy import BACKOFFS, GROWTHS, HostState, ScalePolicy, f32

FP16_MAX = 65504.0
#: The largest fp16 value as a share of 2**16: a mantissa (frexp) above it cannot take 2**16.
_TOP_MANTISSA = FP16_MAX / 2.0**16
#: The first step's scale (at most): scaling by 1 cannot make the backward overflow.
FIRST_SCALE = 1.0
#: The initial safety margin, 2**1: the measured magnitude may double before the next step
#: overflows. Enough for the launcher's GPT and MLP, whose largest gradients are parameter grads.
INITIAL_MARGIN_LOG2 = 1
MIN_MARGIN_LOG2 = 0
MAX_MARGIN_LOG2 = 24
#: Clean steps in a row with the target above the scale before the scale may double.
RISE_AFTER = 2
#: Bounds of the target's exponent: the scale and its reciprocal stay normal fp32 numbers.
MIN_TARGET_LOG2 = -100
MAX_TARGET_LOG2 = 100


@dataclass(frozen=True)
class PredictiveHost:
    """The predictive rule's state as Python numbers.

    ``margin_log2``, ``rise_tracker`` and ``measured`` are what a resume needs (state dict);
    ``grad_max_abs`` (unscaled, agreed over ranks, from the last clean step), ``target_scale``
    and ``underflow_fraction`` (largest over ranks, last sample) are telemetry; NaN until known.
    """

    margin_log2: int = INITIAL_MARGIN_LOG2
    rise_tracker: int = 0
    measured: bool = False
    grad_max_abs: float = math.nan
    target_scale: float = math.nan
    underflow_fraction: float = math.nan

    def as_list(self) -> list[float]:
        """The order of the device vector."""
        return [
            float(self.margin_log2),
            float(self.rise_tracker),
            float(self.measured),
            self.grad_max_abs,
            self.target_scale,
            self.underflow_fraction,
        ]

    @staticmethod
    def from_list(values: list[float]) -> PredictiveHost:
        margin, rise, measured, grad_max_abs, target, underflow = values
        return PredictiveHost(int(margin), int(rise), measured > 0, grad_max_abs, target, underflow)


MARGIN, RISE, MEASURED, GRAD_MAX_ABS, TARGET, UNDERFLOW = range(6)


def first_scale(init_scale: float, min_scale: float | None, max_scale: float | None) -> float:
    """The scale of a new predictive scaler's first step: low enough to measure, not to overflow."""
    scale = min(float(init_scale), FIRST_SCALE)
    if min_scale is not None:
        scale = max(scale, float(min_scale))
    if max_scale is not None:
        scale = min(scale, float(max_scale))
    return scale


def target_log2(grad_max_abs: float, margin_log2: int) -> int:
    """Exponent of the largest power of two keeping ``grad_max_abs * 2**margin_log2`` in fp16.

    ``grad_max_abs`` must be finite and > 0.
    """
    mantissa, exponent = math.frexp(grad_max_abs)  # value = mantissa * 2**exponent, exact
    top = 16 if mantissa <= _TOP_MANTISSA else 15
    return min(max(top - exponent - margin_log2, MIN_TARGET_LOG2), MAX_TARGET_LOG2)


def _clamp(value: float, policy: ScalePolicy) -> float:
    if policy.max_scale is not None:
        value = min(value, f32(policy.max_scale))
    if policy.min_scale is not None:
        value = max(value, f32(policy.min_scale))
    return value


def next_host_state(
    policy: ScalePolicy,
    before: HostState,
    after: HostState,
    p: PredictiveHost,
    found: bool,
    grad_max_abs: float,
    underflow: float,
) -> tuple[HostState, PredictiveHost]:
    """Adjust the dynamic rule's result ``after`` (from ``before``) by the predictive rule."""
    if underflow >= 0:
        p = dataclasses.replace(p, underflow_fraction=underflow)
    if found:
        backed_off = after.counters[BACKOFFS] > before.counters[BACKOFFS]
        margin = min(p.margin_log2 + int(backed_off), MAX_MARGIN_LOG2)
        return after, dataclasses.replace(p, margin_log2=margin, rise_tracker=0)
    margin = p.margin_log2
    if after.growth_tracker == 0:  # growth_interval clean steps in a row: relax the margin
        margin = max(margin - 1, MIN_MARGIN_LOG2)
    has_value = grad_max_abs > 0
    log2 = target_log2(grad_max_abs, margin) if has_value else MAX_TARGET_LOG2
    target = _clamp(math.ldexp(1.0, log2), policy)
    scale, rise = before.scale, 0
    if (not p.measured and has_value) or target <= scale:
        new = target
    else:
        rise = p.rise_tracker + 1
        new = scale
        if rise >= RISE_AFTER:
            new, rise = min(target, math.ldexp(1.0, math.frexp(scale)[1])), 0
    new = f32(new)
    counters = list(after.counters)
    counters[GROWTHS] = before.counters[GROWTHS] + int(new > scale)
    counters[BACKOFFS] = before.counters[BACKOFFS] + int(new < scale)
    host = dataclasses.replace(after, scale=new, counters=tuple(counters))
    return host, PredictiveHost(
        margin_log2=margin,
        rise_tracker=rise,
        measured=p.measured or has_value,
        grad_max_abs=grad_max_abs,
        target_scale=target,
        underflow_fraction=p.underflow_fraction,
    )


def _pow2(log2: torch.Tensor) -> torch.Tensor:
    """``2.0**log2`` as fp32, exactly: the exponent bits written directly (|log2| <= 126)."""
    bits = torch.bitwise_left_shift(log2.to(torch.int32) + 127, 23)
    return bits.view(torch.float32)


def update_(
    policy: ScalePolicy,
    p: torch.Tensor,
    before_scale: torch.Tensor,
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    grad_max_abs: torch.Tensor,
    underflow: torch.Tensor,
) -> None:
    """:func:`next_host_state` as device tensor ops, in place on ``p`` and ``scale``.

    ``scale`` and ``growth_tracker`` hold the dynamic rule's result; ``p`` is the float32 vector
    of :meth:`PredictiveHost.as_list`. No host sync. The growth and back-off counters need no
    op here: the device state counts every rise and fall of the scale from its update log.
    """
    found = found_inf.to(scale.device).reshape(()) > 0
    clean = ~found
    m = grad_max_abs.to(scale.device).float().reshape(())
    u = underflow.to(scale.device).float().reshape(())
    p[UNDERFLOW] = torch.where(u >= 0, u, p[UNDERFLOW])
    backed_off = scale < before_scale
    margin = p[MARGIN]
    margin_up = (margin + backed_off.float()).clamp(max=MAX_MARGIN_LOG2)
    margin_down = torch.where(growth_tracker == 0, (margin - 1).clamp(min=MIN_MARGIN_LOG2), margin)
    margin = torch.where(found, margin_up, margin_down)

    has_value = m > 0
    mantissa, exponent = torch.frexp(torch.where(has_value, m, torch.ones_like(m)))
    top = torch.where(mantissa <= _TOP_MANTISSA, 16, 15).to(torch.int32)
    log2 = (top - exponent.to(torch.int32) - margin.to(torch.int32)).clamp(
        MIN_TARGET_LOG2, MAX_TARGET_LOG2
    )
    log2 = torch.where(has_value, log2, torch.full_like(log2, MAX_TARGET_LOG2))
    target = _pow2(log2)
    if policy.max_scale is not None:
        target = target.clamp(max=policy.max_scale)
    if policy.min_scale is not None:
        target = target.clamp(min=policy.min_scale)

    old = before_scale.reshape(())
    settle = ((p[MEASURED] <= 0) & has_value) | (target <= old)
    rise = torch.where(settle, torch.zeros_like(p[RISE]), p[RISE] + 1)
    doubles = rise >= RISE_AFTER
    up = _pow2(torch.frexp(old)[1])
    new = torch.where(settle, target, torch.where(doubles, torch.minimum(target, up), old))
    rise = torch.where(doubles, torch.zeros_like(rise), rise)

    scale.copy_(torch.where(clean, new, scale))
    p[MARGIN] = margin
    p[RISE] = torch.where(clean, rise, torch.zeros_like(rise))
    p[MEASURED] = torch.where(clean & has_value, torch.ones_like(p[MEASURED]), p[MEASURED])
    p[GRAD_MAX_ABS] = torch.where(clean, m, p[GRAD_MAX_ABS])
    p[TARGET] = torch.where(clean, target, p[TARGET])
