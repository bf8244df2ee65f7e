"""Per-layer precision: which format each linear trains in, agreed by every rank.

A *precision map* is ``dict[str, str]``: layer name -> format name. :class:`PrecisionSchedule`
holds one (each format one of :data:`FORMATS`) with switches at given steps, applied on every rank
at the same step, logged, served, checkpointed and compared across ranks through the scaler's one
collective. :class:`ShadowNumerics` samples what each format would saturate and flush on layers
still in high precision or FP8, and :func:`propose_precision_map` turns its table into a map. The
formats are named in :mod:`dscale.precision._formats` only. Importing this package does not
import torchao; building a schedule does. See docs/block-scaled.md.
"""

from dscale.precision._checks import check_schedule
from dscale.precision._formats import (
    BF16,
    BF16_FORWARD,
    FORMATS,
    MXFP8,
    MXFP8_WGRAD_WITH_HP,
    ROWWISE,
    TENSORWISE,
)
from dscale.precision._propose import PrecisionProposal, propose_precision_map
from dscale.precision._schedule import PrecisionSchedule
from dscale.precision._shadow import ShadowNumerics

__all__ = [
    "BF16",
    "BF16_FORWARD",
    "FORMATS",
    "MXFP8",
    "MXFP8_WGRAD_WITH_HP",
    "ROWWISE",
    "TENSORWISE",
    "PrecisionProposal",
    "PrecisionSchedule",
    "ShadowNumerics",
    "check_schedule",
    "propose_precision_map",
]
