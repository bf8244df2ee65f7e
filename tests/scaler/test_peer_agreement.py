"""What the benchmark's peer does with one rank's inf: ShardedGradScaler agrees only on some paths.

The 2-rank benchmark compares dscale with ShardedGradScaler "making the same collective". With a
fused optimizer it makes none: its fused path checks each rank's grads without the all-reduce its
``unscale_()`` makes, so a rank whose grads are finite steps and grows its scale while the rank
with the inf skips. Calling ``unscale_()`` first makes it agree (the benchmark's
``sharded_unscaled`` arm). dscale agrees on every path. One spawn, 2 gloo ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.multirank import run_ranks


def _one_step(rank: int, make_scaler, impl: str, unscale_first: bool) -> tuple[list[float], float]:
    param = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([param], lr=0.1, **{impl: True})
    scaler = make_scaler()
    scaler.scale(param.sum()).backward()
    if rank == 1:
        param.grad[0] = float("inf")
    if unscale_first:
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return param.detach().tolist(), scaler.get_scale()


def _cases(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    import dscale

    scalers = {
        "sharded": lambda: ShardedGradScaler(device="cpu", init_scale=2.0**8, growth_interval=1),
        "dscale": lambda: dscale.GradScaler("cpu", init_scale=2.0**8, growth_interval=1),
    }
    out = {}
    for name, make in scalers.items():
        for impl in ("foreach", "fused"):
            for unscale_first in (False, True):
                out[(name, impl, unscale_first)] = _one_step(rank, make, impl, unscale_first)
    return out


def test_sharded_grad_scaler_skips_one_ranks_inf_on_that_rank_only_with_a_fused_optimizer():
    results = run_ranks(_cases, world_size=2)
    skipped = ([1.0] * 4, 2.0**7)  # the step skipped, the scale halved
    for key, on_rank0 in results[0].items():
        name, impl, unscale_first = key
        assert results[1][key] == skipped, key  # rank 1 holds the inf: it always skips
        diverges = name == "sharded" and impl == "fused" and not unscale_first
        if diverges:  # rank 0 stepped and grew its scale: the ranks no longer hold one model
            assert on_rank0[0] != [1.0] * 4 and on_rank0[1] == 2.0**9, key
        else:
            assert on_rank0 == skipped, key
