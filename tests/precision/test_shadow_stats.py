"""Each format's shadow shares, exact against a brute-force reference and torchao's quantizers.

Oracles: tests/precision/_brute.py (element by element in Python floats) on the same tensor,
and, where torchao quantizes on the CPU, its own output (``to_mx``, ``NVFP4Tensor.to_nvfp4``):
an element is flushed when it is non-zero and torchao's quantized value of it is zero.
"""

from __future__ import annotations

import math

import pytest
import torch

from dscale.precision._shadow_stats import SHADOW_FORMATS, format_stats
from tests.precision import _brute


def _tensors() -> dict[str, torch.Tensor]:
    """2 x 64 and wider: 2+ MXFP8 blocks and 4+ NVFP4 blocks per row."""
    g = torch.Generator().manual_seed(7)
    normal = torch.randn(4, 64, generator=g)
    outlier = normal.clone()
    outlier[1, 3] = 1e6  # one huge element: its tensor, row, block flush the rest
    floor = normal.clone()
    floor[0, :32] = torch.randn(32, generator=g) * 1e-39  # below 448 x 2^-127: E8M0's floor
    ceiling = normal.clone()
    ceiling[2, 32:64] = torch.rand(32, generator=g) * 3.3e38  # next to float32's max
    with_inf = normal.clone()
    with_inf[3, 40] = math.inf
    with_nan = normal.clone()
    with_nan[0, 20] = math.nan
    return {
        "zeros": torch.zeros(2, 64),
        "subnormal_only": torch.randn(2, 64, generator=g) * 1e-42,  # float32 subnormals
        "wide": torch.randn(4, 64, generator=g) * torch.logspace(-7, 2, 64),
        "outlier": outlier,
        "scale_floor": floor,
        "scale_ceiling": ceiling,
        "inf": with_inf,
        "nan": with_nan,
    }


TENSORS = _tensors()


@pytest.mark.parametrize("name", sorted(TENSORS))
def test_every_format_equals_the_brute_force_reference(name):
    """Saturated and flushed shares of every format and operand equal the reference's, exactly
    (all-zero, subnormal-only, an outlier, blocks at E8M0's floor and next to float32's max,
    an inf, a NaN)."""
    x = TENSORS[name]
    for fmt in SHADOW_FORMATS:
        for operand in ("input", "weight", "grad_output"):
            got = format_stats(x, fmt, operand).tolist()
            assert got == _brute.reference(x, fmt, operand), (name, fmt, operand)


def test_the_cases_exercise_what_they_name():
    """Guards the oracle's coverage: the outlier flushes, NVFP4 with an inf loses every finite
    element, an all-zero tensor flushes nothing, E8M0's floor flushes its block under MXFP8."""
    assert format_stats(TENSORS["outlier"], "tensorwise", "input")[1] > 0.5
    blocks = TENSORS["inf"].reshape(-1, 16)
    finite_blocks = torch.isfinite(blocks).all(dim=-1, keepdim=True) & (blocks != 0)
    assert format_stats(TENSORS["inf"], "nvfp4", "input")[1] == finite_blocks.float().sum() / 256
    assert all(format_stats(TENSORS["zeros"], f, "input").sum() == 0 for f in SHADOW_FORMATS)
    assert format_stats(TENSORS["scale_floor"], "mxfp8", "input")[1] >= 32 / 256


@pytest.mark.parametrize("name", ["wide", "outlier", "scale_floor", "scale_ceiling", "inf"])
def test_flushed_shares_equal_torchaos_own_quantization(name):
    """MXFP8: torchao's ``to_mx`` (RCEIL) data; NVFP4 (finite tensors, in bfloat16 as
    ``NVFP4Linear`` casts them): ``NVFP4Tensor.to_nvfp4`` with the per-tensor scale,
    dequantized: the share of non-zero elements quantized to 0."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    from dscale.fp8 import _torchao

    x = TENSORS[name]
    to_mx, rceil = _torchao.to_mx()
    _, data = to_mx(x.contiguous(), torch.float8_e4m3fn, 32, rceil)
    lost = (x != 0) & torch.isfinite(x) & (data.float() == 0)
    assert format_stats(x, "mxfp8", "input")[1] == lost.sum() / x.numel(), name
    if torch.isfinite(x).all():
        b = x.to(torch.bfloat16)
        t = NVFP4Tensor.to_nvfp4(b, 16, per_tensor_scale=per_tensor_amax_to_scale(b.abs().amax()))
        lost = (b != 0) & (t.dequantize(torch.float32) == 0)
        assert format_stats(x, "nvfp4", "input")[1] == lost.sum() / x.numel(), name


def test_a_last_dim_off_the_block_is_measured_zero_padded():
    """48 features (not a multiple of 32): MXFP8's shares are those of the tensor padded with
    zeros to 64, per real element (the reference on the padded tensor, rescaled)."""
    x = TENSORS["wide"][:, :48]
    padded = torch.nn.functional.pad(x, (0, 16))
    for fmt in ("mxfp8", "nvfp4"):
        want = [v * 64 / 48 for v in _brute.reference(padded, fmt, "input")]
        assert format_stats(x, fmt, "input").tolist() == pytest.approx(want, rel=1e-6, abs=0)
