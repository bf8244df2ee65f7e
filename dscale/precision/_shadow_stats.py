"""What each format would do to a tensor: the shares of elements it saturates and flushes.

Pure functions (tensor -> float32 ``[saturated, flushed]``), one per format a layer could take,
each in the orientation its forward and grad_input GEMMs cast (scales along the last dim):

* ``tensorwise``: torchao's tensorwise float8 recipe, E4M3 for input and weight, E5M2 for
  grad_output, scale ``fp8_max / amax`` (:func:`tensorwise_stats`).
* ``rowwise``: torchao's rowwise recipe, E4M3 everywhere, a power-of-two scale per row
  (:func:`dscale.fp8._granular.rowwise_stats`).
* ``mxfp8``: torchao's ``to_mx`` (E4M3 elements, an E8M0 exponent per 32, RCEIL)
  (:func:`dscale.fp8._granular.mx_stats`).
* ``nvfp4``: as torchao's ``NVFP4Linear`` casts (in bfloat16, the per-tensor scale
  ``amax / (448 * 6)``, E2M1 elements, an E4M3 scale per 16 along the last dim, per 16 x 16
  tile for the weight) (:func:`dscale.fp8.nvfp4_stats`). Round to
  nearest: torchao rounds grad_output stochastically, so there the share is an expectation.

``saturated``: finite elements beyond the format's maximum under their own scale (clamped);
``flushed``: non-zero elements cast to zero (including those a non-finite neighbour wipes out:
MXFP8's 31 others of a block holding an inf; under NVFP4 one inf makes the tensor scale inf:
every finite block flushes, and the inf's own block turns NaN, which is lost but not counted).
A tensor whose last dim is not a multiple of a block format's block is measured zero-padded to
one (the padding neither saturates nor flushes; shares are of the real elements): what the
format would do if the layer could take it (a layer whose dims it cannot take stays bf16 in a
proposal, :mod:`dscale.precision._propose`).
"""

from __future__ import annotations

import torch

from dscale.fp8 import _granular
from dscale.precision._formats import MXFP8, NVFP4, ROWWISE, TENSORWISE

#: The formats measured, in the order of the vector (convert_to_float8's recipes).
SHADOW_FORMATS = (TENSORWISE, ROWWISE, MXFP8, NVFP4)
#: The fields per (operand, format).
FIELDS = ("saturated", "flushed")
#: Each block format's block along the last dim.
BLOCKS = {MXFP8: _granular.MX_BLOCK, NVFP4: 16}
E4M3 = torch.float8_e4m3fn
EPS = 1e-12  # torchao's floor on an amax


def _padded(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` as 2D rows, the last dim zero-padded to a multiple of ``block``."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    pad = -rows.shape[-1] % block
    return torch.nn.functional.pad(rows, (0, pad)) if pad else rows


def nvfp4_stats(x: torch.Tensor, operand: str) -> torch.Tensor:
    """``[saturated, flushed]`` of ``x`` as torchao's ``NVFP4Linear`` would cast it
    (:func:`dscale.fp8.nvfp4_stats`): in bfloat16, the per-tensor scale
    ``amax / (448 * 6)``, an E4M3 scale per 1 x 16 block along the last dim (input,
    grad_output) or per 16 x 16 tile (the weight), E2M1 elements."""
    from dscale.fp8 import nvfp4_stats as measure

    n = x.numel()
    rows = BLOCKS[NVFP4] if operand == "weight" else 1
    padded = _padded(x.detach().to(torch.bfloat16), BLOCKS[NVFP4])
    if rows > 1 and padded.shape[0] % rows:
        padded = torch.nn.functional.pad(padded, (0, 0, 0, -padded.shape[0] % rows))
    stats = measure(padded, rows=rows)
    return stats[1:3] * (padded.numel() / n)


def tensorwise_stats(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[saturated, flushed]`` of ``x`` under torchao's tensorwise scale, computed as its
    ``amax_to_scale`` does: ``fp8_max / amax`` in float64, then float32. (In float32 the
    division can land one ulp off and saturate the amax element by 3e-5.)"""
    x = x.detach().float()
    info = torch.finfo(dtype)
    amax = x.abs().amax()
    scale = (info.max / amax.double().clamp(min=EPS)).float()
    scaled = x * scale
    q = scaled.clamp(-info.max, info.max).to(dtype).float()
    n = x.numel()
    saturated = (torch.isfinite(x) & (scaled.abs() > info.max)).sum() / n
    flushed = ((x != 0) & (q == 0)).sum() / n
    return torch.stack([saturated, flushed]).float()


def format_stats(x: torch.Tensor, fmt: str, operand: str) -> torch.Tensor:
    """``[saturated, flushed]`` of ``x`` (the layer's ``operand``) under ``fmt`` (float32)."""
    x = x.detach()
    n = x.numel()
    if n == 0:
        return torch.zeros(len(FIELDS), device=x.device)
    if fmt == NVFP4:
        return nvfp4_stats(x, operand)
    if fmt == TENSORWISE:
        return tensorwise_stats(x, torch.float8_e5m2 if operand == "grad_output" else E4M3)
    if fmt == ROWWISE:
        return _granular.rowwise_stats(x, E4M3, True)[1:3]
    if fmt == MXFP8:
        rows = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        padded = _padded(rows, BLOCKS[MXFP8])
        return _granular.mx_stats(padded, E4M3)[1:3] * (padded.numel() / n)
    raise ValueError(f"format must be one of {SHADOW_FORMATS}, got {fmt!r}")


def all_stats(x: torch.Tensor, operand: str) -> torch.Tensor:
    """Every format's ``[saturated, flushed]`` of ``x``, in :data:`SHADOW_FORMATS` order."""
    return torch.cat([format_stats(x, fmt, operand) for fmt in SHADOW_FORMATS])
