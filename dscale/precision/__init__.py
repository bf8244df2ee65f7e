"""Per-layer precision: shadow numerics of every format, and a proposed precision map.

A *precision map* is ``dict[str, str]``: layer name -> format name (``convert_to_float8``'s
recipes, ``"nvfp4"``, or ``"bf16"`` for a layer left in high precision).
"""

from dscale.precision._propose import PrecisionProposal, propose_precision_map
from dscale.precision._shadow import ShadowNumerics

__all__ = ["PrecisionProposal", "ShadowNumerics", "propose_precision_map"]
