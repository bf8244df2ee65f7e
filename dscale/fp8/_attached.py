"""What dscale.fp8 records against a scaler: its FP8 companions, for the exporter and checkpoints.

``WeightScales``, ``Float8Numerics``, ``Float8Fallback``, ``NVFP4Seeds`` and ``dscale.precision``'s
``PrecisionSchedule`` record themselves here against their scaler (weakly: nothing is kept alive),
so ``dscale.metrics.start_exporter`` serves and ``MetricsLog`` logs the FP8 numerics of a job with
no extra code, and ``dscale.checkpoint`` saves and loads their state with the scaler's
(:func:`companions`) without the user naming them. (Their agreement fields register with the
scaler itself: ``GradScaler.add_agreement_field``.)
"""

from __future__ import annotations

import weakref
from typing import Any

_weight_scales: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_numerics: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_fallback: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_schedule: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_nvfp4: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

#: The checkpoint key of each companion (the launcher's, and what docs/fp8.md passed as extra=).
#: (``dscale.precision``'s schedule loads before the fallback, whose switches go through it.)
KEYS = {
    "fp8_weight_scales": _weight_scales,
    "fp8_numerics": _numerics,
    "precision_schedule": _schedule,
    "fp8_fallback": _fallback,
    "fp8_nvfp4": _nvfp4,
}
#: Every live (not closed) companion per scaler and key: a second one (two models on one scaler,
#: torch's multi-model recipe) would not travel under the one key (:func:`shadowed`).
_live: weakref.WeakKeyDictionary[Any, dict[str, weakref.WeakSet[Any]]] = weakref.WeakKeyDictionary()


def _record(key: str, scaler: Any, obj: Any) -> None:
    KEYS[key][scaler] = obj
    _live.setdefault(scaler, {}).setdefault(key, weakref.WeakSet()).add(obj)


def attach_weight_scales(scaler: Any, scales: Any) -> None:
    """Record ``scales`` (a WeightScales) as ``scaler``'s (the latest one wins)."""
    _record("fp8_weight_scales", scaler, scales)


def attach_numerics(scaler: Any, numerics: Any) -> None:
    """Record ``numerics`` as ``scaler``'s (the latest one wins)."""
    _record("fp8_numerics", scaler, numerics)


def attach_fallback(scaler: Any, fallback: Any) -> None:
    """Record ``fallback`` as ``scaler``'s (the latest one wins)."""
    _record("fp8_fallback", scaler, fallback)


def attach_schedule(scaler: Any, schedule: Any) -> None:
    """Record ``schedule`` (a dscale.precision.PrecisionSchedule) as ``scaler``'s."""
    _record("precision_schedule", scaler, schedule)


def schedule_of(scaler: Any) -> Any:
    """``scaler``'s ``PrecisionSchedule``, or None."""
    return _schedule.get(scaler)


def attach_nvfp4(scaler: Any, seeds: Any) -> None:
    """Record ``seeds`` (an NVFP4Seeds: per-rank SR seeds and signs) as ``scaler``'s."""
    _record("fp8_nvfp4", scaler, seeds)


def detach(scaler: Any, obj: Any) -> None:
    """Forget ``obj`` (a closed companion) if it is still ``scaler``'s."""
    for key, table in KEYS.items():
        _live.get(scaler, {}).get(key, weakref.WeakSet()).discard(obj)
        if table.get(scaler) is obj:
            del table[scaler]


def numerics_of(scaler: Any) -> Any:
    """``scaler``'s ``Float8Numerics``, or None."""
    return _numerics.get(scaler)


def fallback_of(scaler: Any) -> Any:
    """``scaler``'s ``Float8Fallback``, or None."""
    return _fallback.get(scaler)


def companions(scaler: Any) -> dict[str, Any]:
    """``scaler``'s FP8 companions by checkpoint key (weight scales, numerics, precision
    schedule, fallback order: a fallback's load switches layers, through the schedule where there
    is one, after the numerics it reads are restored)."""
    found = {}
    for key, table in KEYS.items():
        obj = table.get(scaler)
        if obj is not None:
            found[key] = obj
    return found


def shadowed(scaler: Any) -> dict[str, list[Any]]:
    """Per key, the live companions of ``scaler`` that :func:`companions` does not return (an
    earlier one, not closed, where a later one was recorded under the same key)."""
    out = {}
    for key, live in _live.get(scaler, {}).items():
        latest = KEYS[key].get(scaler)
        others = [obj for obj in list(live) if obj is not latest]
        if others:
            out[key] = others
    return out
