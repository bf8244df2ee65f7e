"""What update() watches for after the decision: a scale stuck at its floor, a run of spikes.

Both act on counters the update already keeps (no host sync while the host holds the state;
after device-side updates the collapse check reads the device every ``stuck_patience`` steps).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

from dscale.scaler._program import scale_rule as _policy

if TYPE_CHECKING:
    from dscale.scaler._program.spike_gate import SpikeGate
    from dscale.scaler._state.book import ScaleState

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


def collapse_check_due(
    book: ScaleState, min_scale: float | None, patience: int, unchecked: int
) -> tuple[bool, int]:
    """Whether :func:`watch_for_collapse` runs after this update, and the updates left unchecked.

    Free while the host holds the state: every update is checked. After device-side updates
    the read waits for the device, so only every ``patience``-th update is.
    """
    if min_scale is None:
        return False, unchecked
    if book.host is None:
        unchecked += 1
        if unchecked < patience:
            return False, unchecked
        unchecked = 0
    return True, unchecked


def watch_for_collapse(
    book: ScaleState,
    min_scale: float,
    *,
    on_stuck_at_min: StuckPolicy,
    patience: int,
    loss_scaling: bool,
) -> None:
    """Act on a scale stuck at min_scale for ``patience`` skipped steps in a row."""
    state = book.read()  # free while the host holds the state
    in_a_row = state.counters[_policy.SKIPPED_IN_A_ROW]
    if state.scale > min_scale or in_a_row < patience:
        return
    latest = state.counters[_policy.STEPS] - 1
    if not loss_scaling:  # a StepGuard: no scale to blame
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
    if on_stuck_at_min == "raise":
        raise ScaleCollapsedError(message)
    logger.warning("%s", message)


def watch_spikes(gate: SpikeGate | None, *, patience: int, warned_at: int) -> int:
    """Warn when the spike gate has skipped ``patience`` steps in a row.

    ``warned_at``: the run length last warned about (0: none); returns the new one.
    """
    if gate is None:
        return warned_at
    # The newest counters the host holds (no wait): a warning may come a step or two late.
    in_a_row = int(gate.snapshot(wait=False)["spike_skipped_in_a_row"])
    if in_a_row < patience:
        return 0
    if in_a_row >= warned_at + patience:
        logger.warning(
            "the spike gate skipped the last %d steps in a row: the loss or grad norm has "
            "stayed above the window's mean + %g standard deviations. Skipped values never "
            "enter the window, so a lasting change of level is skipped for good: raise "
            "spike_sigma, or load a state dict without the spike_* keys to start a fresh "
            "window",
            in_a_row,
            gate.sigma,
        )
        return in_a_row
    return warned_at
