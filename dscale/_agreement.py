"""The scaler's one collective: every rank learns whether any rank saw an inf or NaN.

All cross-rank agreement goes through :func:`all_reduce_flag`, so tests can count it by patching
this single function.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_reduce_flag(flag: torch.Tensor, group: Any) -> Any:
    """Start a MAX all-reduce of the one-element overflow ``flag`` in place; return its work handle.

    MAX, not SUM: one rank's inf must skip the step on every rank, and the flag stays 0 or 1-ish
    whatever the world size. The call is asynchronous; on NCCL ``work.wait()`` only makes the
    current CUDA stream wait, so the host never blocks here.
    """
    return dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)


def all_reduce_min_max(values: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise (min, max) of ``values`` over ``group``; blocking. Used by rare checks only."""
    lo = values.clone()
    hi = values.clone()
    if group is not None:
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return lo, hi
