"""Entrypoints for tests/launch/test_entrypoints.py (run with the launcher's cwd = this folder)."""

from __future__ import annotations

import torch.distributed as dist

NOT_A_FUNCTION = 3


def raise_on_rank_1(ctx) -> None:
    """Rank 1 raises; rank 0 waits in a collective that rank 1 never joins."""
    if ctx.rank == 1:
        raise ValueError("boom from the user's code")
    dist.barrier()


def own_scaler(ctx) -> dict:
    """Trains through a GradScaler of its own, not ctx.scaler; rank 1's grads overflow at step 3."""
    import torch

    import dscale

    scaler = dscale.GradScaler(device="cpu", init_scale=8192.0, growth_interval=1000)
    model = ctx.parallelize(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        if step == 2 and ctx.rank == 1:
            next(model.parameters()).grad.fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return {"own_scale": scaler.get_scale()}


def step_twice_on_rank_1(ctx) -> None:
    """Rank 1 calls scaler.step() twice (a misuse dscale refuses); rank 0 meets a collective."""
    import torch

    model = ctx.parallelize(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ctx.autocast():
        loss = model(torch.ones(2, 4)).float().sum()
    ctx.scaler.scale(loss).backward()
    ctx.scaler.step(opt)
    if ctx.rank == 1:
        ctx.scaler.step(opt)
    ctx.scaler.update()
    dist.barrier()
