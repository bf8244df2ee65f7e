"""The scaler's state-dict format: torch's five keys, then dscale's own, with full validation.

A dict saved by ``torch.amp.GradScaler`` loads (dscale's trackers then start fresh), and a dscale
dict loads into torch's scaler, which reads its five keys and ignores the rest.

Keys:
    scale: current scale (float). growth_factor, backoff_factor, growth_interval: as torch.
    _growth_tracker: consecutive clean steps since the last growth or overflow (int).
    dscale_format_version: this format's version (int).
    min_scale, max_scale: clamp bounds (float or None). hysteresis: overflows tolerated before a
    back-off (int). hysteresis_refill: "on_growth" or "on_clean_step".
    _hysteresis_tracker: overflows still tolerated (int).
    num_steps, num_skipped_steps, num_skipped_in_a_row, num_growths, num_backoffs: counters (int).

Version 3 (a StepGuard, or the spike gate on; ``dscale/scaler/_program/spike_gate.py``) adds:
    loss_scaling: False for a StepGuard (its scale is fixed at 1); absent means True.
    spike_signals: the watched values, comma-separated ("loss,grad_norm").
    spike_window_values: the window, a float64 tensor [signals, spike_window] (a ring).
    spike_window_entered: values that ever entered the window (the ring's write position).
    num_spike_skipped_steps, num_spike_skipped_in_a_row: the gate's skips (overflows apart).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import torch

from dscale.scaler._program.scale_rule import COUNTER_NAMES, HostState, ScalePolicy, f32

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
#: Version 2 adds policy="predictive"'s keys (``_state.predictive``); dynamic dicts stay 1.
#: Version 3 adds a StepGuard's and the spike gate's keys; dicts without them keep 1 or 2.
#: Version 4: policy="predictive"'s window replaces its margin keys.
GUARD_FORMAT_VERSION = 3
NEWEST_FORMAT_VERSION = 4

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
COUNTER_KEYS = tuple(f"num_{name}" for name in COUNTER_NAMES)
HYSTERESIS_REFILLS = ("on_growth", "on_clean_step")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_scale_args(
    *,
    init_scale: Any,
    growth_factor: Any,
    backoff_factor: Any,
    growth_interval: Any,
    min_scale: Any = None,
    max_scale: Any = None,
    hysteresis: Any = 1,
    hysteresis_refill: Any = "on_growth",
    prefix: str = "",
    within_bounds: bool = False,
) -> None:
    """Raise ValueError naming the first bad argument, its value and the fix.

    ``within_bounds``: ``init_scale`` must lie within ``[min_scale, max_scale]`` too.
    """
    if not _is_real(init_scale) or not math.isfinite(init_scale) or init_scale <= 0:
        raise ValueError(
            f"{prefix}init_scale must be a finite number > 0, got {init_scale!r}; "
            "it is the loss multiplier at the start (torch's default is 65536.0)"
        )
    if not _is_real(growth_factor) or not math.isfinite(growth_factor) or growth_factor <= 1.0:
        raise ValueError(
            f"{prefix}growth_factor must be a finite number > 1, got {growth_factor!r}; "
            "it multiplies the scale after growth_interval clean steps (torch's default is 2.0)"
        )
    if not _is_real(backoff_factor) or not 0.0 < backoff_factor < 1.0:
        raise ValueError(
            f"{prefix}backoff_factor must be in (0, 1), got {backoff_factor!r}; "
            "it multiplies the scale after an overflow (torch's default is 0.5)"
        )
    if not _is_int(growth_interval) or growth_interval < 1:
        raise ValueError(
            f"{prefix}growth_interval must be an int >= 1, got {growth_interval!r}; "
            "it is the number of clean steps before the scale grows (torch's default is 2000)"
        )
    for name, bound in (("min_scale", min_scale), ("max_scale", max_scale)):
        if bound is not None and (not _is_real(bound) or not math.isfinite(bound) or bound <= 0):
            raise ValueError(f"{prefix}{name} must be None or a finite number > 0, got {bound!r}")
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ValueError(
            f"{prefix}min_scale={min_scale!r} is larger than max_scale={max_scale!r}; "
            "swap them or drop one"
        )
    if within_bounds and min_scale is not None and init_scale < min_scale:
        raise ValueError(f"{prefix}init_scale={init_scale!r} is below min_scale={min_scale!r}")
    if within_bounds and max_scale is not None and init_scale > max_scale:
        raise ValueError(f"{prefix}init_scale={init_scale!r} is above max_scale={max_scale!r}")
    if not _is_int(hysteresis) or hysteresis < 1:
        raise ValueError(
            f"{prefix}hysteresis must be an int >= 1, got {hysteresis!r}; it is how many "
            "overflows are tolerated before the scale backs off (1 = torch's behaviour)"
        )
    if hysteresis_refill not in HYSTERESIS_REFILLS:
        raise ValueError(
            f"{prefix}hysteresis_refill must be one of {HYSTERESIS_REFILLS}, got "
            f"{hysteresis_refill!r}"
        )


def checked_new_scale(new_scale: float | torch.Tensor) -> float | torch.Tensor:
    """update(new_scale=...)'s argument, or ValueError saying what it must be."""
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad:
            raise ValueError(
                "new_scale must be a float or a one-element tensor with requires_grad=False, "
                f"got a tensor of shape {tuple(new_scale.shape)}"
            )
        return new_scale
    if (
        isinstance(new_scale, bool)
        or not isinstance(new_scale, (int, float))
        or not (math.isfinite(new_scale) and new_scale > 0)
    ):
        raise ValueError(f"new_scale must be a finite number > 0, got {new_scale!r}")
    return float(new_scale)


def validate(state: Mapping[str, Any]) -> dict[str, Any]:
    """Check a state dict completely; return it normalised (no scaler is touched here).

    Raises:
        ValueError: naming the key and the value when anything is missing or out of range.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"a GradScaler state dict must be a dict, got {type(state).__name__}")
    if len(state) == 0:
        raise ValueError(
            "the GradScaler state dict is empty, possibly because it was saved from a disabled "
            "scaler; load it into a disabled scaler or drop it"
        )
    missing = [k for k in TORCH_KEYS if k not in state]
    if missing:
        raise ValueError(
            f"the GradScaler state dict lacks {missing}; it has {sorted(state)}. Pass a dict "
            "returned by GradScaler.state_dict() (torch's or dscale's)"
        )
    out = dict(state)
    for key in ("scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
        value = out.get(key)
        if isinstance(value, torch.Tensor):  # a 0-dim tensor, e.g. after a DCP round trip
            out[key] = float(value.item())
    for key in (
        "growth_interval",
        "_growth_tracker",
        "hysteresis",
        "_hysteresis_tracker",
        "dscale_format_version",
        *COUNTER_KEYS,
    ):
        value = out.get(key)
        if isinstance(value, torch.Tensor):
            out[key] = int(value.item())
    version = out.get("dscale_format_version", FORMAT_VERSION)
    if not _is_int(version) or version > NEWEST_FORMAT_VERSION:
        raise ValueError(
            f"dscale_format_version={version!r} is newer than this dscale understands "
            f"({NEWEST_FORMAT_VERSION}); upgrade dscale to load it"
        )
    check_scale_args(
        init_scale=out["scale"],
        growth_factor=out["growth_factor"],
        backoff_factor=out["backoff_factor"],
        growth_interval=out["growth_interval"],
        min_scale=out.get("min_scale"),
        max_scale=out.get("max_scale"),
        hysteresis=out.get("hysteresis", 1),
        hysteresis_refill=out.get("hysteresis_refill", "on_growth"),
        prefix="state_dict: ",
    )
    for key in ("_growth_tracker", "_hysteresis_tracker", *COUNTER_KEYS):
        if key in out and (not _is_int(out[key]) or out[key] < 0):
            raise ValueError(f"state_dict: {key} must be an int >= 0, got {out[key]!r}")
    return out


def scales_loss(state: Mapping[str, Any]) -> bool:
    """False for a dict saved by a StepGuard (``loss_scaling: False``)."""
    value = state.get("loss_scaling", True)
    if isinstance(value, torch.Tensor):
        value = bool(value.item())
    return bool(value)


def to_state_dict(policy: ScalePolicy, host: HostState) -> dict[str, Any]:
    """The state dict of a scaler with ``policy`` and state ``host``."""
    return {
        "scale": float(host.scale),
        "growth_factor": policy.growth_factor,
        "backoff_factor": policy.backoff_factor,
        "growth_interval": policy.growth_interval,
        "_growth_tracker": host.growth_tracker,
        "dscale_format_version": FORMAT_VERSION,
        "min_scale": policy.min_scale,
        "max_scale": policy.max_scale,
        "hysteresis": policy.hysteresis,
        "hysteresis_refill": policy.hysteresis_refill,
        "_hysteresis_tracker": host.hysteresis_tracker,
        **dict(zip(COUNTER_KEYS, host.counters, strict=True)),
    }


def from_state_dict(
    state: Mapping[str, Any], current: ScalePolicy
) -> tuple[ScalePolicy, HostState]:
    """Validate ``state`` and turn it into a policy and a state; ``current`` fills missing keys.

    Raises:
        ValueError: naming the key and the value; nothing has been changed anywhere.
    """
    s = validate(state)
    policy = ScalePolicy(
        growth_factor=float(s["growth_factor"]),
        backoff_factor=float(s["backoff_factor"]),
        growth_interval=int(s["growth_interval"]),
        min_scale=s.get("min_scale", current.min_scale),
        max_scale=s.get("max_scale", current.max_scale),
        hysteresis=int(s.get("hysteresis", current.hysteresis)),
        hysteresis_refill=s.get("hysteresis_refill", current.hysteresis_refill),
    )
    check_scale_args(init_scale=1.0, **asdict(policy), prefix="state_dict: ")
    hysteresis_tracker = int(s.get("_hysteresis_tracker", policy.hysteresis))
    if hysteresis_tracker > policy.hysteresis:  # the rule only ever refills it to hysteresis
        raise ValueError(
            f"state_dict: _hysteresis_tracker={hysteresis_tracker} exceeds "
            f"hysteresis={policy.hysteresis}; a scaler never holds more tolerated overflows than "
            "its hysteresis: fix the dict, or set hysteresis to at least the tracker"
        )
    scale = float(s["scale"])
    clamped = min(max(scale, policy.min_scale or scale), policy.max_scale or scale)
    if clamped != scale:
        logger.warning(
            "loaded scale %g lies outside [min_scale, max_scale]; using %g", scale, clamped
        )
    host = HostState(
        f32(clamped),
        int(s["_growth_tracker"]),
        hysteresis_tracker,
        tuple(int(s.get(k, 0)) for k in COUNTER_KEYS),
    )
    return policy, host
