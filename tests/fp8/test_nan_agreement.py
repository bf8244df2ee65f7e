"""A NaN riding the MAX agreement vector from a non-zero rank must not vanish.

gloo's MAX all-reduce (NCCL's too, MS-AMP PR #58) drops a NaN sent by a non-zero rank: the raw
collective hands every rank the other ranks' value. ``dscale._agreement.all_reduce_flag`` sends
every field NaN -> +inf, so the NaN arrives as inf on every rank. The raw collective is the
negative control, run in the same spawn.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from dscale import _agreement
from tests.multirank import run_ranks


def _vector(rank: int, nan_rank: int) -> torch.Tensor:
    # [flag-like, amax-like, a -inf slot as the spike gate sends for other ranks' slots]
    values = torch.tensor([0.0, 5.0, -math.inf])
    if rank == nan_rank:
        values[0] = values[1] = math.nan
    return values


def _reduce_both_ways(rank: int, world: int) -> dict[int, tuple[list[float], list[float]]]:
    out = {}
    for nan_rank in range(world):
        raw = _vector(rank, nan_rank)
        dist.all_reduce(raw, op=dist.ReduceOp.MAX)
        ours = _vector(rank, nan_rank)
        _agreement.all_reduce_flag(ours, None).wait()
        out[nan_rank] = (raw.tolist(), ours.tolist())
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_nan_from_any_rank_arrives_as_inf_where_the_raw_max_drops_it(world):
    results = run_ranks(_reduce_both_ways, world_size=world)
    for rank, per_nan_rank in results.items():
        for nan_rank, (raw, ours) in per_nan_rank.items():
            # dscale: the NaN arrives as +inf on every rank, whichever rank sent it.
            assert ours == [math.inf, math.inf, -math.inf], (rank, nan_rank)
            if nan_rank > 0:  # the raw collective: the NaN is gone, 5.0 won
                assert raw[:2] == [0.0, 5.0], (rank, nan_rank, raw)
