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


def fsdp_block_forms(ctx) -> dict:
    """One model in three forms of ``blocks`` under ``ctx.parallelize`` (parallel=fsdp).

    ``attribute``: ``self.blocks = nn.ModuleList(...)`` (docs/fp8.md's idiom); ``method``:
    ``def blocks(self)`` (the demo's); ``wrong``: ``blocks`` a Linear, which must be refused with
    what is expected. The first two train three steps from the same seed and data; their losses
    and which submodules FSDP2 sharded are returned.
    """
    import torch
    from torch import nn
    from torch.distributed.fsdp import FSDPModule

    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return self.head(x)

    class AsAttribute(Body):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = self.layers

    class AsMethod(Body):
        def blocks(self):
            return list(self.layers)

    class Wrong(Body):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = self.head

    out: dict = {}
    for name, cls in (("attribute", AsAttribute), ("method", AsMethod)):
        model = ctx.parallelize(cls())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + ctx.rank)
            loss = model(torch.randn(4, 8, generator=g).to(ctx.device)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[name] = {
            "losses": losses,
            "sharded": [isinstance(m, FSDPModule) for m in model.layers],
        }
    try:
        ctx.parallelize(Wrong())
        out["wrong"] = None
    except ValueError as exc:
        out["wrong"] = str(exc)
    return out


def demo_on_the_mesh(ctx) -> dict:
    """The demo, plus what the context told this entrypoint about the job's mesh."""
    from launch import demo

    result = demo.main(ctx)
    names = ctx.mesh.mesh_dim_names
    return {
        **result,
        "mesh": {name: ctx.mesh[name].size() for name in names},
        "mesh_coordinate": ctx.mesh.get_coordinate(),
        "data_rank": ctx.data_rank,
        "data_ranks": ctx.data_ranks,
        # The spike gate's grad norm of the last step (scaler.spike_signals=[grad_norm]).
        "gate_grad_norm": ctx.scaler.snapshot().get("spike_grad_norm"),
    }
