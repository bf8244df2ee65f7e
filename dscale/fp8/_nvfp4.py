"""NVFP4 numerics: what torchao's ``NVFP4Tensor.to_nvfp4`` does to a tensor, as one stats vector.

NVFP4 (torchao 0.18, ``nvfp4_quantize`` with a per-tensor scale, the two-level scaling its
``NVFP4Linear`` trains with): E2M1 elements (max 6, smallest non-zero 0.5), one E4M3 scale per 16
elements along the last dim, and one float32 per-tensor scale ``amax / (448 * 6)``. Per block:
``s = clamp((block_amax / 6) / tensor_scale, 2^-6, 448)`` cast to E4M3, elements
``clamp(x * ((1 / tensor_scale) / s), -6, 6)`` cast to E2M1 (round to nearest, ties to even).

:func:`nvfp4_stats` returns ``NVFP4_FIELDS`` as one float32 vector, each field worse when larger
(the worst rank's ride a MAX all-reduce):

* ``amax``, ``saturated``, ``flushed``, ``subnormal``: as for every recipe (the shares of elements
  beyond E2M1's 6 under their block's scale before the clamp, non-zero and cast to 0, cast to
  E2M1's one subnormal magnitude 0.5).
* ``blocks_clamped``: the share of blocks holding a non-zero finite value whose E4M3 scale the
  clamp changed, given the tensor scale: below torchao's floor 2^-6 (E4M3's smallest normal; the
  block's elements flush) or above 448 (they saturate).
* ``blocks_nonfinite``: the share of blocks whose decoded values are not all finite. In torchao's
  quantize one inf makes the tensor scale inf and so every block non-finite (share 1).
* ``scale_spread``: log2 of the largest over the smallest decoded E4M3 block scale among blocks
  holding a non-zero finite value (binades; E4M3 scales are not powers of two).
* ``tensor_scale``: the float32 per-tensor scale used (larger with a larger amax; inf for an
  inf amax).

Pure: no state, no collective; the same ops on every call for a given shape (no host read).
"""

from __future__ import annotations

import torch

NVFP4_FIELDS = (
    "amax",
    "saturated",
    "flushed",
    "subnormal",
    "blocks_clamped",
    "blocks_nonfinite",
    "scale_spread",
    "tensor_scale",
)
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E2M1_SMALLEST_NORMAL = 1.0
E4M3_MAX = 448.0
E4M3_EPS = 2.0**-6  # torchao's floor on a block scale: float8_e4m3fn's smallest normal (finfo.tiny)


def tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """torchao's ``per_tensor_amax_to_scale``: ``amax / (448 * 6)`` in float32."""
    return amax.to(torch.float32) / (E4M3_MAX * E2M1_MAX)


def _e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` (already within [-6, 6]) rounded to E2M1's grid, nearest with ties to even.

    The grid is 0, 0.5, 1, 1.5, 2, 3, 4, 6: steps 0.5 below 2, 1 below 4, 2 up to 6; rounding
    ``x / step`` half to even gives the even-mantissa tie rule (torch.round is half-to-even).
    """
    a = x.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.sign(x) * torch.round(a / step) * step


def nvfp4_stats(
    x: torch.Tensor, per_tensor_scale: torch.Tensor | None = None, *, rows: int = 1
) -> torch.Tensor:
    """``NVFP4_FIELDS`` of ``x`` quantized as torchao's NVFP4 (blocks of 16 on the last dim).

    ``per_tensor_scale`` defaults to torchao's dynamic one, ``amax(|x|) / (448 * 6)``; pass an
    agreed one (from a MAX-agreed amax) to measure a shard as the gathered tensor is cast.
    ``rows=16`` measures 16 x 16 tiles (one E4M3 scale per tile of a 2-d tensor: the weight
    cast of torchao's ``NVFP4Linear``); ``rows=1`` the 1 x 16 blocks of ``to_nvfp4``.
    """
    if rows not in (1, NVFP4_BLOCK):
        raise ValueError(f"rows must be 1 (1 x 16 blocks) or 16 (16 x 16 tiles), got {rows!r}")
    if (
        x.dim() < (1 if rows == 1 else 2)
        or x.shape[-1] % NVFP4_BLOCK
        or (rows > 1 and x.numel() and x.reshape(-1, x.shape[-1]).shape[0] % rows)
    ):
        raise ValueError(
            f"NVFP4 blocks 16 elements along the last dim (and {rows} rows); got a tensor of "
            f"shape {tuple(x.shape)}: measure a tensor whose last dim (and rows, for tiles) "
            "are multiples of 16"
        )
    fields = len(NVFP4_FIELDS)
    if x.numel() == 0:  # an empty shard (uneven FSDP2 sharding): nothing to measure
        return torch.zeros(fields, device=x.device)
    x = x.detach().float()
    if rows == 1:
        blocks = x.reshape(-1, NVFP4_BLOCK)
    else:  # [R, K] -> [R/16, 16, K/16, 16] -> one row of 256 per tile
        k = x.shape[-1]
        tiles = x.reshape(-1, rows, k // NVFP4_BLOCK, NVFP4_BLOCK).permute(0, 2, 1, 3)
        blocks = tiles.reshape(-1, rows * NVFP4_BLOCK)
    amax = blocks.abs().amax()
    pts = tensor_scale(amax) if per_tensor_scale is None else per_tensor_scale.float().reshape(())
    block_amax = blocks.abs().amax(dim=-1, keepdim=True)
    wanted = (block_amax / E2M1_MAX) / pts
    s = wanted.clamp(min=E4M3_EPS, max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    scaled = blocks * ((1.0 / pts) / s)
    q = _e2m1(scaled.clamp(-E2M1_MAX, E2M1_MAX))
    n = blocks.numel()
    finite = torch.isfinite(blocks)
    saturated = (finite & (scaled.abs() > E2M1_MAX)).sum() / n
    flushed = ((blocks != 0) & (q == 0)).sum() / n
    subnormal = ((q != 0) & (q.abs() < E2M1_SMALLEST_NORMAL)).sum() / n
    nblocks = blocks.shape[0]
    live = (torch.isfinite(block_amax) & (block_amax > 0)).squeeze(-1)
    clamped_mask = ((wanted < E4M3_EPS) | (wanted > E4M3_MAX)).squeeze(-1)
    clamped = (live & clamped_mask).sum() / nblocks
    decoded = q * (pts * s)  # torchao's dequantize: E2M1 value x (tensor scale x block scale)
    nonfinite = (~torch.isfinite(decoded)).any(dim=-1).sum() / nblocks
    logs = torch.log2(s.squeeze(-1))
    spread = torch.where(
        live.any(),
        torch.where(live, logs, -torch.inf).amax() - torch.where(live, logs, torch.inf).amin(),
        torch.zeros((), device=x.device),
    )
    return torch.stack(
        [amax, saturated, flushed, subnormal, clamped, nonfinite, spread, pts]
    ).float()


def linear_class() -> type:
    """torchao's ``NVFP4Linear`` (``torchao.prototype.moe_training.nvfp4_training``, 0.18)."""
    from dscale.fp8 import _torchao

    _torchao.float8()  # the install line when torchao is missing
    module = _torchao._import_quietly(
        "torchao.prototype.moe_training.nvfp4_training.nvfp4_training"
    )
    return module.NVFP4Linear  # type: ignore[no-any-return]


def layer_stats(x: torch.Tensor, tensor: str) -> torch.Tensor:
    """``NVFP4_FIELDS`` of what an ``NVFP4Linear`` casts: the tensor in bfloat16 (the layer
    casts input and weight to it; grad_output is its output's dtype), the weight in 16 x 16 tiles
    (its forward GEMM's 2-d weight cast), input and grad_output in 1 x 16 blocks along the last
    dim (the forward and grad_input GEMMs' row casts). Round to nearest: torchao's backward
    rounds grad_output stochastically, so its flushed share there is this one's in expectation
    only, not per element. The transposed, Hadamard-rotated casts of grad_weight's GEMM are not
    measured."""
    x = x.detach()
    if x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)
    if tensor == "weight":
        return nvfp4_stats(x, rows=NVFP4_BLOCK)
    return nvfp4_stats(x.reshape(-1, x.shape[-1]) if x.dim() else x)
