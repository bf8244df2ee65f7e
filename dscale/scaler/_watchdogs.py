"""What update() watches for after the decision: a scale stuck at its floor, a run of spikes.

Both act on counters the update already keeps (no host sync while the host holds the state;
after device-side updates the collapse check reads the device every ``stuck_patience`` steps).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

from dscale.scaler._program import scale_rule as _policy

if TYPE_CHECKING:
    from dscale.scaler._api import GradScaler

logger = logging.getLogger("dscale.scaler")

StuckPolicy = Literal["raise", "warn"]


class ScaleCollapsedError(RuntimeError):
    """The scale sits at ``min_scale`` and steps keep overflowing (``on_stuck_at_min="raise"``)."""


def check_stuck_args(on_stuck_at_min: Any, stuck_patience: Any) -> None:
    """Raise ValueError naming the bad argument."""
    if on_stuck_at_min not in ("raise", "warn"):
        raise ValueError(f"on_stuck_at_min must be 'raise' or 'warn', got {on_stuck_at_min!r}")
    if (
        not isinstance(stuck_patience, int)
        or isinstance(stuck_patience, bool)
        or (stuck_patience < 1)
    ):
        raise ValueError(f"stuck_patience must be an int >= 1, got {stuck_patience!r}")


def watch_for_collapse(scaler: GradScaler) -> None:
    """Act on a scale stuck at min_scale; after device-side updates, checks every N steps."""
    min_scale = scaler._policy.min_scale
    if min_scale is None:
        return
    if scaler._book.host is None:
        scaler._updates_since_stuck_check += 1
        if scaler._updates_since_stuck_check < scaler._stuck_patience:
            return
        scaler._updates_since_stuck_check = 0
    state = scaler._book.read()  # free while the host holds the state
    in_a_row = state.counters[_policy.SKIPPED_IN_A_ROW]
    if state.scale > min_scale or in_a_row < scaler._stuck_patience:
        return
    latest = state.counters[_policy.STEPS] - 1
    if not scaler._loss_scaling:  # a StepGuard: no scale to blame
        logger.warning(
            "the last %d steps in a row were skipped for inf/NaN gradients on some rank (the "
            "latest at step index %d): look for the parameters with non-finite grads "
            "(dscale_nonfinite_grads_total) or a diverged loss",
            in_a_row,
            latest,
        )
        return
    message = (
        f"loss scale is stuck at min_scale={min_scale:g}: the last {in_a_row} "
        f"steps in a row were skipped for inf/NaN gradients (the latest at step index "
        f"{latest}). The gradients overflow even at the smallest scale: look "
        "for the parameters with non-finite grads (dscale_nonfinite_grads_total) or a "
        "diverged loss, or lower min_scale."
    )
    if scaler._on_stuck_at_min == "raise":
        raise ScaleCollapsedError(message)
    logger.warning("%s", message)


def watch_spikes(scaler: GradScaler) -> None:
    """Warn when the spike gate has skipped ``stuck_patience`` steps in a row."""
    gate = scaler._spike
    if gate is None:
        return
    # The newest counters the host holds (no wait): a warning may come a step or two late.
    in_a_row = int(gate.snapshot(wait=False)["spike_skipped_in_a_row"])
    if in_a_row < scaler._stuck_patience:
        scaler._spike_warned_at = 0
    elif in_a_row >= scaler._spike_warned_at + scaler._stuck_patience:
        scaler._spike_warned_at = in_a_row
        logger.warning(
            "the spike gate skipped the last %d steps in a row: the loss or grad norm has "
            "stayed above the window's mean + %g standard deviations. Skipped values never "
            "enter the window, so a lasting change of level is skipped for good: raise "
            "spike_sigma, or load a state dict without the spike_* keys to start a fresh "
            "window",
            in_a_row,
            gate.sigma,
        )
