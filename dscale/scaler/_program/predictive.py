"""``policy="predictive"``: set the scale from a window of measured gradient magnitudes.

Every rank measures the largest gradient magnitude of its step, in scaled units (``g``: the grads
as the backward left them, carrying the scale ``s``; ``grad_measure``); a rank whose grads hold
an inf or NaN reports :data:`OVERFLOW_MARK` instead. The value rides on the step's one MAX
all-reduce, so every rank computes the same next scale here.

The rule keeps what each step asks of the scale, as an unscaled magnitude ``e``, in two rings:
the last ``window`` steps' entries (the measurements), and the last ``memory`` steps' overflow
entries (0 for a clean step). It sets the scale to the largest power of two that keeps the largest
entry of either, times ``2**MARGIN_LOG2``, within fp16's largest finite value (:data:`BUDGET` /
``max``), clamped to ``[min_scale, max_scale]``:

* **Clean step:** ``e = g / s``, the largest unscaled magnitude. The measurement window (8
  steps by default) is short, so the scale follows gradients that shrink (a warm-up, a model
  that learns, a loss weight that sweeps) within a few steps, while one batch with small
  gradients does not lift it (Transformer Engine's delayed scaling for FP8 keeps an amax history
  the same way).
* **Overflow:** ``e = OVERFLOW_MARK / s``, which sets the scale to ``s / 2``: torch's back-off.
  It enters both rings, so it is remembered for ``memory`` steps (``growth_interval``: as long as
  the dynamic rule stays backed off), and a spike that overflowed once finds a scale with room
  for it when it comes again. A policy other than torch's rule (hysteresis, a back-off factor
  other than 0.5, min/max) runs the dynamic rule first and enters ``BUDGET / s_dynamic``: the
  scale it chose, remembered.
* **Nothing measured** (every grad zero, or none): ``e = BUDGET / s``, which asks for the scale
  it has: through a phase without gradients the scale holds, and the phase does not empty the
  window of the measurements before it (their maximum would otherwise drop as they leave).

The rings replace the last-step rule with its widening and relaxing margin, which forgot a
periodic spike before it came again, and read "nothing measured" as "the target is the maximum",
doubling the scale through a phase of zero gradients.

Growth and back-off counters count every rise (on a clean step) and fall of the scale. The host
and device forms below compute bit-identical results: the same float32 divisions, and the power
of two taken from the exponent bits of a normal float32.
"""

from __future__ import annotations

import collections
import math
import struct
from dataclasses import dataclass

import torch

from dscale.scaler._program.scale_rule import (
    BACKOFFS,
    GROWTHS,
    HostState,
    ScalePolicy,
    f32,
    is_torch_rule,
)

FP16_MAX = 65504.0
#: The headroom kept above the largest magnitude in the rings: 2**1. With the power of two
#: rounded down below it, the scale keeps between 2x and 4x (a margin of 2**0.5 overflowed once
#: on the zoo's ``spiky`` and the ``wide`` model where the dynamic rule from 2**16 did not).
MARGIN_LOG2 = 1
#: fp16's largest value over the margin, as float32: the scale is the largest power of two
#: <= BUDGET / max.
BUDGET = f32(FP16_MAX * 2.0**-MARGIN_LOG2)
#: What an overflowed rank reports as its measurement (scaled units): the largest power of two
#: <= BUDGET / (MARK / s) is s / 2, torch's back-off.
OVERFLOW_MARK = FP16_MAX
#: The smallest entry the rule takes: the target stays at most 2**100 (a finite float32 whose
#: reciprocal is normal), however small the gradients. A constant word next to the rings.
FLOOR = BUDGET * 2.0**-100
#: The first step's scale (at most): scaling by 1 cannot make the backward overflow.
FIRST_SCALE = 1.0
#: The float32 exponent bits: a normal float with its mantissa cleared is a power of two.
_EXPONENT_BITS = 0x7F800000
_F32 = struct.Struct("<f")
_I32 = struct.Struct("<i")


def first_scale(init_scale: float, min_scale: float | None, max_scale: float | None) -> float:
    """The scale of a new predictive scaler's first step: low enough to measure, not to overflow."""
    scale = min(float(init_scale), FIRST_SCALE)
    if min_scale is not None:
        scale = max(scale, float(min_scale))
    if max_scale is not None:
        scale = min(scale, float(max_scale))
    return scale


def is_lean(policy: ScalePolicy) -> bool:
    """torch's rule with a back-off of 0.5: the window alone decides (no dynamic rule runs)."""
    return is_torch_rule(policy) and policy.backoff_factor == 0.5


def pow2_floor(value: float) -> float:
    """The largest power of two <= ``value`` (positive, normal float32), from its exponent bits."""
    (bits,) = _I32.unpack(_F32.pack(value))
    return float(_F32.unpack(_I32.pack(bits & _EXPONENT_BITS))[0])


def div32(a: float, b: float) -> float:
    """``a / b`` as float32 division gives it, inf (or NaN) for b == 0 instead of an error.

    After about 110 overflows in a row the scale underflows to 0, as torch's does after about
    150; the rule then goes on as the device form does rather than raising.
    """
    if b == 0.0:
        return math.nan if a == 0.0 or math.isnan(a) else math.copysign(math.inf, a)
    return f32(a / b)


def target_scale(policy: ScalePolicy, window_max: float) -> float:
    """The scale the window asks for: the largest power of two within BUDGET / ``window_max``."""
    target = pow2_floor(div32(BUDGET, window_max))
    if policy.min_scale is not None:
        target = max(target, f32(policy.min_scale))
    if policy.max_scale is not None:
        target = min(target, f32(policy.max_scale))
    return target


class Window:
    """The ring of entries on the host, with its maximum kept in O(1) per step.

    ``slots`` is the ring as the device holds it (``pos``: the slot the next entry overwrites);
    the deque holds (step, entry) pairs with decreasing entries, so its front is the maximum
    over the last ``len(slots)`` steps.
    """

    def __init__(self, slots: list[float], pos: int) -> None:
        self.slots = slots
        self.pos = pos
        self.step = 0
        self._max: collections.deque[tuple[int, float]] = collections.deque()
        n = len(slots)
        for k in range(n):  # oldest (at pos) to newest
            self._push(slots[(pos + k) % n])

    def _push(self, entry: float) -> None:
        while self._max and self._max[-1][1] <= entry:
            self._max.pop()
        self._max.append((self.step, entry))
        self.step += 1
        while self._max[0][0] <= self.step - 1 - len(self.slots):
            self._max.popleft()

    @property
    def max(self) -> float:
        """The largest entry (0.0 for an empty window)."""
        return self._max[0][1] if self._max else 0.0

    def add(self, entry: float) -> float:
        """Overwrite the oldest entry with ``entry``; return the new maximum."""
        self.slots[self.pos] = entry
        self.pos = (self.pos + 1) % len(self.slots)
        self._push(entry)
        return self._max[0][1]


@dataclass(frozen=True)
class Telemetry:
    """What the last update measured and decided (NaN until known); replaced whole each update.

    ``grad_max_abs``: the largest unscaled magnitude the last step measured, agreed over ranks
    (NaN when it overflowed, 0 when it measured nothing);
    ``window_max``: the largest entry in the window; ``target_scale``: the scale it asks for;
    ``underflow_fraction``: the largest share over ranks of grad elements below fp16's smallest
    normal number at the scale, from the last sampled step.
    """

    grad_max_abs: float = math.nan
    window_max: float = math.nan
    target_scale: float = math.nan
    underflow_fraction: float = math.nan


def next_host_state(
    policy: ScalePolicy,
    before: HostState,
    after: HostState,
    window: Window,
    memory: Window,
    found: bool,
    measured: float,
) -> tuple[HostState, float]:
    """The host form: adds this step's entry to both rings; returns the new state and the entry.

    ``after`` is the dynamic rule's result from ``before``; ``measured`` is the agreed
    measurement in scaled units (``OVERFLOW_MARK`` where a rank overflowed).
    """
    s = before.scale
    asked = div32(measured if measured > 0 else BUDGET, s)  # nothing measured: hold s
    if is_lean(policy):
        entry = asked
        # The dynamic rule does not run here: its trackers keep the values the device log gives.
        tracker = before.growth_tracker
        hyst = before.hysteresis_tracker
        if found:
            hyst = 0
        elif policy.hysteresis_refill == "on_clean_step" or tracker == 0:
            hyst = policy.hysteresis
    else:
        entry = div32(BUDGET, after.scale) if found else asked
        tracker, hyst = after.growth_tracker, after.hysteresis_tracker
    window_max = max(window.add(entry), memory.add(entry if found else 0.0), FLOOR)
    new = target_scale(policy, window_max)
    counters = list(after.counters)
    counters[GROWTHS] = before.counters[GROWTHS] + int(new > s and not found)
    counters[BACKOFFS] = before.counters[BACKOFFS] + int(new < s)
    host = HostState(new, tracker, hyst, tuple(counters))
    return host, entry


def update_(
    policy: ScalePolicy,
    rings: torch.Tensor,
    window: torch.Tensor,
    memory: torch.Tensor,
    pos: tuple[int, int],
    scale: torch.Tensor,
    before: torch.Tensor | None,
    found: torch.Tensor,
    measured: torch.Tensor,
    budget: torch.Tensor,
    asked: torch.Tensor,
) -> None:
    """:func:`next_host_state` as device tensor ops, in place on the rings and ``scale``.

    ``rings``: both rings and the :data:`FLOOR` word, contiguous (``window`` and ``memory`` are
    views of it); ``pos``: the slot each ring overwrites. ``scale`` holds the step's scale (lean
    policy) or the dynamic rule's result, and then ``before`` the step's scale. ``found`` is 0
    or 1. ``budget`` is :data:`BUDGET` as a tensor on the device. ``asked`` (a 0-d float32 word
    on the device) receives what the step asked for in scaled units: ``measured``, or BUDGET
    when it measured nothing, so that a reader can tell the two apart after the log is folded.
    No host sync; six ops for the lean policy.
    """
    slot = window[pos[0]]
    # Nothing measured (0) asks for BUDGET: hold the scale. One op: where(measured > 0, ...) is two.
    # (NaN would stay NaN here, where the host form holds; every writer of `measured` passes it
    # through nan_to_num, so it is never NaN.) Written where it is kept: no op more.
    torch.threshold(measured, 0.0, BUDGET, out=asked)
    if before is None:
        torch.div(asked, scale, out=slot)
    else:
        backed = torch.div(budget, scale)
        torch.where(found > 0, backed, torch.div(asked, before), out=slot)
    torch.mul(slot, found, out=memory[pos[1]])  # the entry of an overflow, else 0
    window_max = rings.amax()
    if policy.min_scale is None and policy.max_scale is None:
        torch.div(budget, window_max, out=scale)
        scale.view(torch.int32).bitwise_and_(_EXPONENT_BITS)
        return
    target = torch.div(budget, window_max)
    target.view(torch.int32).bitwise_and_(_EXPONENT_BITS)
    scale.copy_(target.clamp(policy.min_scale, policy.max_scale))


def traced_update_(
    policy: ScalePolicy,
    rings: torch.Tensor,
    window: torch.Tensor,
    memory: torch.Tensor,
    pos: tuple[int, int],
    scale: torch.Tensor,
    before: torch.Tensor | None,
    found: torch.Tensor,
    measured: torch.Tensor,
    budget: torch.Tensor,
) -> None:
    """:func:`update_` under torch.compile, with the positions ``pos`` fixed: each ring turns
    by one (its oldest entry leaves) and the new entry goes into the slot before ``pos``, so
    the ring read from ``pos`` on holds what :func:`update_` leaves read from ``pos + 1`` on.
    The same values bit for bit (the entry, the maximum, the scale)."""
    asked = torch.threshold(measured, 0.0, BUDGET)
    if before is None:
        entry = torch.div(asked, scale)
    else:
        entry = torch.where(found > 0, torch.div(budget, scale), torch.div(asked, before))
    for ring, at, value in ((window, pos[0], entry), (memory, pos[1], torch.mul(entry, found))):
        turned = torch.roll(ring, -1)
        turned[(at - 1) % ring.numel()] = value
        ring.copy_(turned)
    target = torch.div(budget, rings.amax())
    target = (target.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)
    if policy.min_scale is not None or policy.max_scale is not None:
        target = target.clamp(policy.min_scale, policy.max_scale)
    scale.copy_(target)
