"""Brute-force references for the shadow numerics: element by element, in Python floats.

Tensorwise and NVFP4 are computed here (each scale as torchao computes it, rounded to float32
where torchao's arithmetic is float32; each scaled element rounded to the nearest value of the
format by a table of its bit patterns, ties to even); rowwise and MXFP8 reuse the references of
tests/fp8/test_numerics_granular.py. Each returns ``[saturated, flushed]`` as float32 shares.
"""

from __future__ import annotations

import math
import struct

import torch

from tests.fp8.test_numerics_granular import _f32, _mx_reference, _round, _rowwise_reference

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # bit patterns 0..7


def f32(v: float) -> float:
    """``v`` rounded to float32 (inf beyond its range)."""
    try:
        return float(struct.unpack("f", struct.pack("f", v))[0])
    except OverflowError:
        return math.copysign(math.inf, v)


def _round_e2m1(v: float) -> float:
    a = abs(v)
    best = min(E2M1, key=lambda c: (abs(c - a), E2M1.index(c) % 2))  # ties to the even pattern
    return math.copysign(best, v)


def _amax(values: list[float]) -> float:
    return math.nan if any(math.isnan(v) for v in values) else max(map(abs, values), default=0.0)


def tensorwise(x: torch.Tensor, dtype: torch.dtype) -> list[float]:
    info = torch.finfo(dtype)
    flat = x.flatten().tolist()
    amax = _amax(flat)
    sat = flush = 0
    if not math.isnan(amax):
        scale = 0.0 if amax == math.inf else f32(info.max / max(amax, 1e-12))
        for v in flat:
            if not math.isfinite(v):
                continue
            s = f32(v * scale)
            sat += abs(s) > info.max
            q = _round(min(max(s, -info.max), info.max), dtype)
            flush += v != 0 and q == 0
    return [_f32(sat, len(flat)), _f32(flush, len(flat))]


def nvfp4(x: torch.Tensor, tiles: bool = False) -> list[float]:
    """torchao's NVFP4Linear cast: bfloat16, the per-tensor scale amax / (448 * 6), blocks of
    1 x 16 along the last dim (``tiles``: 16 x 16, the weight's; rows zero-padded to 16)."""
    e4m3 = torch.float8_e4m3fn
    tiny, top = torch.finfo(e4m3).tiny, torch.finfo(e4m3).max
    n = x.numel()
    x = x.to(torch.bfloat16).float().reshape(-1, x.shape[-1])
    size = 16
    if tiles:
        x = torch.nn.functional.pad(x, (0, 0, 0, -x.shape[0] % 16))
        k = x.shape[-1]
        x = x.reshape(-1, 16, k // 16, 16).permute(0, 2, 1, 3).reshape(-1, 256)
        size = 256
    flat = x.flatten().tolist()
    amax = _amax(flat)
    sat = flush = 0
    if math.isnan(amax):
        return [0.0, 0.0]
    if amax == math.inf:  # the tensor scale is inf: finite blocks scale to 0, a block holding
        # the inf to NaN (its scale is inf / inf)
        for i in range(0, len(flat), size):
            block = flat[i : i + size]
            if all(math.isfinite(v) for v in block):
                flush += sum(1 for v in block if v != 0)
        return [0.0, _f32(flush, n)]
    ts = f32(amax / (448.0 * 6.0))
    for i in range(0, len(flat), size):
        block = flat[i : i + size]
        bs = f32(f32(max(abs(v) for v in block) / 6.0) / ts) if ts else math.nan
        bs = tiny if math.isnan(bs) else bs  # 0 / 0 (an all-zero tensor): clamped to tiny
        bs8 = _round(min(max(bs, tiny), top), e4m3)
        rcp = f32(f32(1.0 / ts) / bs8) if ts else math.inf
        for v in block:
            s = f32(v * rcp) if v else 0.0
            sat += abs(s) > 6.0
            flush += v != 0 and _round_e2m1(min(max(s, -6.0), 6.0)) == 0
    return [_f32(sat, n), _f32(flush, n)]


def reference(x: torch.Tensor, fmt: str, operand: str) -> list[float]:
    """``[saturated, flushed]`` of ``x`` under ``fmt`` (last dim a multiple of 32)."""
    if fmt == "tensorwise":
        dtype = torch.float8_e5m2 if operand == "grad_output" else torch.float8_e4m3fn
        return tensorwise(x, dtype)
    if fmt == "nvfp4":
        return nvfp4(x, tiles=operand == "weight")
    ref = (
        _rowwise_reference(x, torch.float8_e4m3fn)
        if fmt == "rowwise"
        else _mx_reference(x, torch.float8_e4m3fn)
    )
    return [ref["saturated"], ref["flushed"]]
