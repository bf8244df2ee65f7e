"""Spread a model over the ranks as ``parallel.strategy`` says: DDP, FSDP2, or nothing."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


def wrap_model(model: nn.Module, strategy: str, device: torch.device) -> nn.Module:
    """Move ``model`` to ``device`` and wrap it: DDP, FSDP2 ``fully_shard``, or not at all.

    FSDP2 shards each of the model's blocks (:func:`fsdp_blocks`), then the root, so each
    block's parameters are gathered only while that block runs.
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
        for block in fsdp_blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return model


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: ``model.blocks``, in either of two forms.

    An attribute (or property) that holds the modules: an ``nn.ModuleList`` or ``nn.Sequential``
    (its modules), an ``nn.ModuleDict`` (its values) or a list of modules, as in
    ``self.blocks = nn.ModuleList(...)``; or a method ``blocks()`` returning the same (``return
    self.layers``, a list, a generator). No ``blocks``: [] (only the root is sharded). Anything
    else is a ValueError saying what is expected (a container module is callable: calling it ran
    its missing ``forward``).
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return []
    method = callable(blocks) and not isinstance(blocks, nn.Module)
    found = blocks() if method else blocks
    modules = _modules(found)
    if modules is not None:
        return modules
    what = f"{'a method returning ' if method else ''}{type(found).__name__} {found!r:.60}"
    raise ValueError(
        f"parallel=fsdp shards each module of {type(model).__name__}.blocks, but it is {what}; "
        "make it an nn.ModuleList attribute (self.blocks = nn.ModuleList([...])) or a method "
        "returning the modules (def blocks(self): return [...]), or give it another name if "
        "it is not the model's blocks"
    )


def _modules(found: object) -> list[nn.Module] | None:
    """The modules ``found`` holds (a container module, or an iterable of modules), else None."""
    if isinstance(found, nn.ModuleDict):
        return list(found.values())
    if isinstance(found, (nn.ModuleList, nn.Sequential)):
        return list(found)
    if isinstance(found, nn.Module) or not isinstance(found, Iterable) or isinstance(found, str):
        return None
    modules = list(found)
    return modules if all(isinstance(m, nn.Module) for m in modules) else None
