"""Numerics of the finer-grained recipes: rowwise (a scale per row) and MXFP8 (one per 32).

Each function returns one float32 vector per tensor, whose fields are worse when larger (so the
worst rank's ride a MAX all-reduce). The first four are tensorwise's, so the same Prometheus
names serve every recipe: ``amax``, and the shares of elements ``saturated`` (beyond the format's
maximum under their own scale, before the clamp), ``flushed`` (non-zero, cast to 0) and
``subnormal`` (cast to a non-zero subnormal). The rest are the recipe's own:

* rowwise (torchao's axiswise casts along the last dim, scales ``fp8_max / row amax`` rounded
  down to a power of two as the recipe sets): ``rows_saturated`` and ``rows_flushed``, the
  shares of rows holding a saturated or a flushed element; ``scale_spread``, log2 of the largest
  over the smallest row scale among rows that are not all zero (binades).
* MXFP8 (torchao's ``to_mx`` with RCEIL: E8M0 exponent ``ceil(log2(block amax / fp8_max))``
  per 32 elements along the last dim, clamped to [-127, 127]): ``blocks_clamped``, the share of
  blocks holding a non-zero value whose exponent sits at E8M0's floor (there torchao scales by 1:
  its values flush); ``blocks_nonfinite``, the share of blocks holding an inf or NaN (one inf
  zeroes the other 31 elements of its block, one NaN makes it NaN); ``scale_spread``, the
  largest minus the smallest exponent among finite, non-zero blocks (binades).

The measured orientation is the one the forward GEMM and grad_input's GEMM cast (the last dim
of input, weight and grad_output); the transposed casts of grad_weight's GEMM are not measured.
"""

from __future__ import annotations

import torch

TENSORWISE_FIELDS = ("amax", "saturated", "flushed", "subnormal")
ROWWISE_FIELDS = (*TENSORWISE_FIELDS, "rows_saturated", "rows_flushed", "scale_spread")
MX_FIELDS = (*TENSORWISE_FIELDS, "blocks_clamped", "blocks_nonfinite", "scale_spread")
FIELDS = {"tensorwise": TENSORWISE_FIELDS, "rowwise": ROWWISE_FIELDS, "mxfp8": MX_FIELDS}
EPS = 1e-12  # torchao's floor on an amax
MX_BLOCK = 32
E8M0_BIAS = 127


def _shares(
    x: torch.Tensor, scaled: torch.Tensor, q: torch.Tensor, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Element shares: saturated (finite elements beyond the max), flushed, subnormal."""
    info = torch.finfo(dtype)
    n = max(x.numel(), 1)
    saturated = (torch.isfinite(x) & (scaled.abs() > info.max)).sum() / n
    flushed = ((x != 0) & (q == 0)).sum() / n
    subnormal = ((q != 0) & (q.abs() < info.smallest_normal)).sum() / n
    return [saturated, flushed, subnormal]


def rowwise_stats(x: torch.Tensor, dtype: torch.dtype, power_of_2: bool = True) -> torch.Tensor:
    """``ROWWISE_FIELDS`` of ``x`` cast to ``dtype`` with one scale per row (last dim)."""
    if x.numel() == 0:  # an empty shard (uneven FSDP2 sharding): nothing to measure
        return torch.zeros(len(ROWWISE_FIELDS), device=x.device)
    x = x.detach().float()
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    info = torch.finfo(dtype)
    row_amax = rows.abs().amax(dim=-1, keepdim=True)
    # torchao's amax_to_scale: in float64, then float32, then down to a power of two.
    scale = (info.max / row_amax.double().clamp(min=EPS)).float()
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    scaled = rows * scale
    q = scaled.clamp(-info.max, info.max).to(dtype).float()
    saturated, flushed, subnormal = _shares(rows, scaled, q, dtype)
    per_row_sat = (torch.isfinite(rows) & (scaled.abs() > info.max)).any(dim=-1)
    per_row_flush = ((rows != 0) & (q == 0)).any(dim=-1)
    live = (row_amax.squeeze(-1) > 0) & torch.isfinite(row_amax.squeeze(-1))
    logs = torch.log2(scale.squeeze(-1))
    spread = torch.where(
        live.any(),
        torch.where(live, logs, -torch.inf).amax() - torch.where(live, logs, torch.inf).amin(),
        torch.zeros(()),
    )
    nrows = max(rows.shape[0], 1)
    amax = rows.abs().amax() if rows.numel() else torch.zeros(())
    return torch.stack(
        [
            amax,
            saturated,
            flushed,
            subnormal,
            per_row_sat.sum() / nrows,
            per_row_flush.sum() / nrows,
            spread,
        ]
    ).float()


def mx_stats(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """``MX_FIELDS`` of ``x`` cast by torchao's ``to_mx`` (RCEIL, blocks of 32 on the last dim)."""
    from dscale.fp8 import _torchao

    if x.numel() == 0:  # an empty shard (uneven FSDP2 sharding): nothing to measure
        return torch.zeros(len(MX_FIELDS), device=x.device)
    to_mx, rceil = _torchao.to_mx()
    x = x.detach()
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    exponent, data = to_mx(x.contiguous(), dtype, MX_BLOCK, rceil)
    blocks = x.float().reshape(-1, MX_BLOCK)
    biased = exponent.view(torch.uint8).reshape(-1, 1).int()
    q = data.float().reshape(-1, MX_BLOCK)
    # torchao's reciprocal scale: 2^(127 - e), 1 at e = 0, 2^-127 for an inf amax (e = 254).
    rcp = torch.where(
        biased == 0,
        1.0,
        torch.where(biased == 254, 2.0**-127, torch.exp2((E8M0_BIAS - biased).float())),
    )
    scaled = blocks * rcp
    saturated, flushed, subnormal = _shares(blocks, scaled, q, dtype)
    block_amax = blocks.abs().amax(dim=-1)
    finite = torch.isfinite(block_amax)
    nonzero = finite & (block_amax > 0)
    nblocks = max(blocks.shape[0], 1)
    clamped = (nonzero & (biased.squeeze(-1) == 0)).sum() / nblocks
    nonfinite = (~finite).sum() / nblocks
    e = biased.squeeze(-1).float()
    spread = torch.where(
        nonzero.any(),
        torch.where(nonzero, e, -torch.inf).amax() - torch.where(nonzero, e, torch.inf).amin(),
        torch.zeros(()),
    )
    amax = blocks.abs().amax() if blocks.numel() else torch.zeros(())
    return torch.stack([amax, saturated, flushed, subnormal, clamped, nonfinite, spread]).float()
