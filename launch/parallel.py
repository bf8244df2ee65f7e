"""Spread a model over the ranks as ``parallel.strategy`` says: DDP, FSDP2, or nothing."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn


def wrap_model(model: nn.Module, strategy: str, device: torch.device) -> nn.Module:
    """Move ``model`` to ``device`` and wrap it: DDP, FSDP2 ``fully_shard``, or not at all.

    FSDP2 shards each module of ``model.blocks()`` (when the model has that method), then the
    root, so each block's parameters are gathered only while that block runs.
    """
    model = model.to(device)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # The demo's loop never modifies the logits in place, which is what this warns about.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        blocks = getattr(model, "blocks", None)
        for block in blocks() if callable(blocks) else []:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return model
