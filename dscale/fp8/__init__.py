"""FP8 training on torchao's float8 kernels, with dscale's agreement (``pip install dscale[fp8]``).

:func:`convert_to_float8` swaps a model's linears (torchao's tensorwise or rowwise recipe, its
MXFP8Linear or its NVFP4Linear); :class:`NVFP4Seeds` keeps NVFP4's Hadamard signs alike on every
rank and its stochastic-rounding seeds per rank; :class:`Float8Numerics` samples their numerics
per tensor, row or 32-block;
:class:`WeightScales` agrees FSDP2 float8 all-gather weight scales inside the scaler's one
collective. Importing this package does not import torchao; the calls do (ImportError with the
install line when it is missing). See docs/fp8.md.
"""

from dscale.fp8._bound import adam_update_bound
from dscale.fp8._collector import Float8NumericsCollector
from dscale.fp8._convert import Float8Conversion, convert_to_float8
from dscale.fp8._fallback import Float8Fallback
from dscale.fp8._layers import LayoutMismatchError
from dscale.fp8._numerics import Float8Numerics, tensor_stats
from dscale.fp8._nvfp4 import NVFP4Seeds
from dscale.fp8._nvfp4_stats import NVFP4_FIELDS, nvfp4_stats
from dscale.fp8._weight_scales import WeightScales

__all__ = [
    "Float8Conversion",
    "Float8Fallback",
    "Float8Numerics",
    "Float8NumericsCollector",
    "LayoutMismatchError",
    "NVFP4_FIELDS",
    "NVFP4Seeds",
    "WeightScales",
    "adam_update_bound",
    "convert_to_float8",
    "nvfp4_stats",
    "tensor_stats",
]
