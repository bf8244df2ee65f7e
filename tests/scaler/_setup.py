"""Builders shared by the scaler tests: a tiny model in each parallel mode, and grad poisoning."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

PARALLEL_MODES = ("ddp", "fsdp1", "fsdp2")


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def wrap(model: nn.Module, parallel: str) -> nn.Module:
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if parallel == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    if parallel == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise ValueError(parallel)


def full_params(model: nn.Module, parallel: str) -> torch.Tensor:
    """All parameters, gathered whole, flattened into one tensor (comparable across ranks)."""
    if parallel == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    parts = []
    for p in model.parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        parts.append(t.reshape(-1).clone())
    return torch.cat(parts)


def poison_first_grad(model: nn.Module) -> None:
    """Put an inf into this rank's local piece of the first gradient that has elements here."""
    for p in model.parameters():
        if p.grad is None:
            continue
        local = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
        if local.numel():
            local.view(-1)[0] = float("inf")
            return
    raise AssertionError("no local gradient to poison on this rank")


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g)


def decide_on_device(scaler):
    """Make a CPU scaler decide fused and sync_free steps on the device, as it does on a GPU.

    On the CPU the agreed flag is in host memory, so the scaler reads it there and updates with
    host arithmetic; tests of the device-side decision (the CUDA path) turn that off to run it.
    """
    scaler._read_host_flags = False
    return scaler


def decision_paths(fused: bool) -> list[tuple[bool, bool]]:
    """(sync_free, on_device) pairs that exercise distinct code: the host decision, the fused
    optimizer's device decision (fused only), and the masked sync_free step on the device."""
    return [(False, False), *([(False, True)] if fused else []), (True, True)]
