"""What each format would do to a tensor: the shares of elements it saturates and flushes.

Pure functions (tensor -> float32 ``[saturated, flushed]``), one per format a layer could take,
each in the orientation its forward and grad_input GEMMs cast (scales along the last dim):

* ``tensorwise``: torchao's tensorwise float8 recipe, E4M3 for input and weight, E5M2 for
  grad_output, scale ``fp8_max / amax`` (:func:`tensorwise_stats`).
* ``rowwise``: torchao's rowwise recipe, E4M3 everywhere, a power-of-two scale per row
  (:func:`dscale.fp8._granular.rowwise_stats`).
* ``mxfp8``: torchao's ``to_mx`` (E4M3 elements, an E8M0 exponent per 32, RCEIL)
  (:func:`dscale.fp8._granular.mx_stats`).
* ``nvfp4``: torchao's ``nvfp4_quantize`` with the per-tensor scale
  ``amax / (448 * 6)`` (``per_tensor_amax_to_scale``): E2M1 elements, an E4M3 scale per 16
  (:func:`nvfp4_stats`).

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

#: The formats measured, in the order of the vector (their names are convert_to_float8's
#: recipes, ``nvfp4`` as v43d adds it).
FORMATS = ("tensorwise", "rowwise", "mxfp8", "nvfp4")
#: The fields per (operand, format).
FIELDS = ("saturated", "flushed")
#: Each block format's block along the last dim.
BLOCKS = {"mxfp8": _granular.MX_BLOCK, "nvfp4": 16}
E4M3 = torch.float8_e4m3fn
F4_MAX = 6.0  # E2M1's largest value
F8_MAX = float(torch.finfo(E4M3).max)
EPS = 1e-12  # torchao's floor on an amax
E4M3_TINY = float(torch.finfo(E4M3).tiny)  # torchao's floor on an NVFP4 block scale


def _padded(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` as 2D rows, the last dim zero-padded to a multiple of ``block``."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    pad = -rows.shape[-1] % block
    return torch.nn.functional.pad(rows, (0, pad)) if pad else rows


def e2m1_flushes(scaled: torch.Tensor) -> torch.Tensor:
    """Where E2M1 rounds a value to zero: |v| <= 0.25 (0.25 ties to the even 0; 0.5 is its
    smallest non-zero value), as torchao's ``f32_to_f4_unpacked`` rounds."""
    return scaled.abs() <= 0.25


def nvfp4_stats(x: torch.Tensor) -> torch.Tensor:
    """``[saturated, flushed]`` of ``x`` under torchao's NVFP4 quantization (two-level scales).

    As ``nvfp4_quantize(x, 16, per_tensor_amax_to_scale(amax(x)))``: block scale
    ``block_amax / 6 / tensor_scale`` rounded to E4M3 (clamped to [tiny, 448]), elements
    ``x / tensor_scale / block_scale`` rounded to E2M1 (clamped to 6).
    """
    n = x.numel()
    if n == 0:
        return torch.zeros(len(FIELDS), device=x.device)
    blocks = _padded(x.detach().float(), BLOCKS["nvfp4"]).reshape(-1, BLOCKS["nvfp4"])
    tensor_scale = blocks.abs().amax() / (F8_MAX * F4_MAX)
    block_scale = (blocks.abs().amax(dim=-1) / F4_MAX) / tensor_scale
    block_fp8 = block_scale.clamp(min=E4M3_TINY, max=F8_MAX).to(E4M3).float()
    scaled = blocks * ((1.0 / tensor_scale) / block_fp8).unsqueeze(-1)
    saturated = (torch.isfinite(blocks) & (scaled.abs() > F4_MAX)).sum() / n
    flushed = ((blocks != 0) & e2m1_flushes(scaled)).sum() / n
    return torch.stack([saturated, flushed]).float()


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
    if fmt == "nvfp4":
        return nvfp4_stats(x)
    x = x.detach()
    n = x.numel()
    if n == 0:
        return torch.zeros(len(FIELDS), device=x.device)
    if fmt == "tensorwise":
        return tensorwise_stats(x, torch.float8_e5m2 if operand == "grad_output" else E4M3)
    if fmt == "rowwise":
        return _granular.rowwise_stats(x, E4M3, True)[1:3]
    if fmt == "mxfp8":
        rows = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        padded = _padded(rows, BLOCKS["mxfp8"])
        return _granular.mx_stats(padded, E4M3)[1:3] * (padded.numel() / n)
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def all_stats(x: torch.Tensor, operand: str) -> torch.Tensor:
    """Every format's ``[saturated, flushed]`` of ``x``, in :data:`FORMATS` order (one vector)."""
    return torch.cat([format_stats(x, fmt, operand) for fmt in FORMATS])
