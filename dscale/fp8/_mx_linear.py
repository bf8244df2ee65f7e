"""dscale's MXFP8 layer: torchao's ``MXFP8Linear`` with nn.Linear's GEMM dtypes under autocast.

torchao 0.18's ``MXFP8Linear`` casts each GEMM operand to MXFP8 from the dtype it is given and
never looks at autocast: ``MXTensor`` keeps that dtype through autocast's cast (its ``.to(dtype)``
returns it unchanged). Its emulation dequantizes each operand back to that dtype, so a bf16
activation (a high-precision linear's output under autocast) and an fp32 weight (AMP's
parameters) meet in one ``torch.mm`` and raise "expected m1 and m2 to have the same dtype"; its
kernels (``torch._scaled_mm``) return bf16 whatever the operands. ``nn.Linear`` under autocast
casts both operands to the autocast dtype; torchao's ``Float8Linear`` casts its input to CUDA's.

So where the input's dtype differs from the weight's under autocast, this layer casts both to
the autocast dtype before torchao's cast (the weight's cast is differentiable: its grad reaches
the fp32 parameter as nn.Linear's does), and the output is in that dtype. Where the dtypes agree
(fp32 without autocast, an all-MXFP8 fp32 model under autocast, a bf16 model) it is torchao's
forward itself, bit for bit. The hot path adds one dtype comparison, no host read.

Imported only through :func:`dscale.fp8._mx.layer_class` (it needs torchao).
"""

from __future__ import annotations

import sys

import torch

from dscale.fp8 import _torchao

_TorchaoMXFP8Linear = _torchao.mxfp8_linear_class()
_to_mxfp8_then_scaled_mm = sys.modules[_TorchaoMXFP8Linear.__module__]._to_mxfp8_then_scaled_mm


class MXFP8Linear(_TorchaoMXFP8Linear):  # type: ignore[misc,valid-type]
    """torchao's ``MXFP8Linear`` whose GEMM operands take the autocast dtype when they differ."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """torchao's forward; under autocast with mixed dtypes, both operands in its dtype."""
        weight = self.weight
        if input.dtype == weight.dtype or not torch.is_autocast_enabled(input.device.type):
            return super().forward(input)  # type: ignore[no-any-return]
        dtype = torch.get_autocast_dtype(input.device.type)
        output = _to_mxfp8_then_scaled_mm(
            input.to(dtype),
            weight.to(dtype),
            kernel_preference=self.kernel_preference,
            scale_calculation_mode=self.scale_calculation_mode,
            wgrad_with_hp=self.wgrad_with_hp,
        )
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output  # type: ignore[no-any-return]
