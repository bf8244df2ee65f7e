"""What dscale.fp8 records against a scaler: its numerics and fallback, for the exporter.

``Float8Numerics`` and ``Float8Fallback`` record themselves here against their scaler (weakly:
nothing is kept alive), so ``dscale.metrics.start_exporter`` serves and ``MetricsLog`` logs the
FP8 numerics of a job with no extra code. (Their agreement fields register with the scaler
itself: ``GradScaler.add_agreement_field``.)
"""

from __future__ import annotations

import weakref
from typing import Any

_numerics: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_fallback: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def attach_numerics(scaler: Any, numerics: Any) -> None:
    """Record ``numerics`` as ``scaler``'s (the latest one wins)."""
    _numerics[scaler] = numerics


def attach_fallback(scaler: Any, fallback: Any) -> None:
    """Record ``fallback`` as ``scaler``'s (the latest one wins)."""
    _fallback[scaler] = fallback


def detach(scaler: Any, obj: Any) -> None:
    """Forget ``obj`` (a closed numerics or fallback) if it is still ``scaler``'s."""
    for table in (_numerics, _fallback):
        if table.get(scaler) is obj:
            del table[scaler]


def numerics_of(scaler: Any) -> Any:
    """``scaler``'s ``Float8Numerics``, or None."""
    return _numerics.get(scaler)


def fallback_of(scaler: Any) -> Any:
    """``scaler``'s ``Float8Fallback``, or None."""
    return _fallback.get(scaler)
