"""The precision formats a layer can run in: the one place that names them.

A *precision map* is ``dict[str, str]``: layer name (as ``model.named_modules()`` gives it) ->
one of :data:`FORMATS`. The float8 names are the recipes :func:`dscale.fp8.convert_to_float8`
takes; ``bf16`` keeps the layer a high-precision ``nn.Linear`` (it computes in the parameters'
dtype, or autocast's); ``bf16_forward`` runs the forward GEMM in high precision and both
backward GEMMs (grad_input, grad_weight) in tensorwise FP8 (torchao's ``Float8LinearConfig``
with the forward's two operands ``DISABLED``: see docs/block-scaled.md, "The precision
schedule", for what torchao 0.18 allows and why there is no MXFP8 or rowwise form of it).
"""

from __future__ import annotations

from typing import Final

BF16: Final = "bf16"
TENSORWISE: Final = "tensorwise"
ROWWISE: Final = "rowwise"
MXFP8: Final = "mxfp8"
MXFP8_WGRAD_WITH_HP: Final = "mxfp8_wgrad_with_hp"
BF16_FORWARD: Final = "bf16_forward"
#: torchao's NVFP4 (``convert_to_float8(recipe="nvfp4")``): measured by shadow numerics and
#: proposable, not yet a schedule format (its training runs only on a GPU).
NVFP4: Final = "nvfp4"

#: Every format a :class:`dscale.precision.PrecisionSchedule` can put a layer in. The order is
#: the state dict's encoding (a format's index): append new names, never reorder.
FORMATS: Final[tuple[str, ...]] = (
    BF16,
    TENSORWISE,
    ROWWISE,
    MXFP8,
    MXFP8_WGRAD_WITH_HP,
    BF16_FORWARD,
)
#: Formats computed by torchao's ``Float8Linear`` (switched among in place, by its config).
FLOAT8_LINEAR: Final[tuple[str, ...]] = (TENSORWISE, ROWWISE, BF16_FORWARD)
#: Formats computed by torchao's ``MXFP8Linear``.
MXFP8_LINEAR: Final[tuple[str, ...]] = (MXFP8, MXFP8_WGRAD_WITH_HP)


def check_format(fmt: object, where: str) -> str:
    """``fmt`` if it names a format; ValueError naming ``where`` and the formats otherwise."""
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ValueError(f"{where}: {fmt!r} is not a precision format; use one of {list(FORMATS)}")
    return fmt
