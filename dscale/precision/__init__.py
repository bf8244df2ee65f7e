"""Per-layer precision: which format each linear trains in, agreed by every rank.

:class:`PrecisionSchedule` holds a *precision map* (layer name -> one of :data:`FORMATS`) with
switches at given steps, applied on every rank at the same step, logged, served, checkpointed
and compared across ranks through the scaler's one collective. The formats are named in
:mod:`dscale.precision._formats` only. Importing this package does not import torchao; building
a schedule does. See docs/block-scaled.md, "The precision schedule".
"""

from dscale.precision._formats import (
    BF16,
    BF16_FORWARD,
    FORMATS,
    MXFP8,
    MXFP8_WGRAD_WITH_HP,
    ROWWISE,
    TENSORWISE,
)
from dscale.precision._schedule import PrecisionSchedule, check_schedule

__all__ = [
    "BF16",
    "BF16_FORWARD",
    "FORMATS",
    "MXFP8",
    "MXFP8_WGRAD_WITH_HP",
    "ROWWISE",
    "TENSORWISE",
    "PrecisionSchedule",
    "check_schedule",
]
