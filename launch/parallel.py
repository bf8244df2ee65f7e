"""Spread a model over the ranks as ``parallel.strategy`` says: DDP, FSDP2, TP, 2-D, HSDP.

The mesh comes from ``launch/mesh.py`` (built once per rank by the worker); pipeline stages are
``launch/pipeline.py``'s, since a stage is not a wrapped model but a part of one.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def wrap_model(
    model: nn.Module,
    strategy: str,
    device: torch.device,
    mesh: DeviceMesh | None = None,
    tp_plan: dict[str, Any] | None = None,
) -> nn.Module:
    """Move ``model`` to ``device`` and spread it over ``mesh`` as ``strategy`` says.

    ddp: DistributedDataParallel. fsdp: FSDP2 shards each of the model's blocks
    (:func:`fsdp_blocks`), then the root, so each block's parameters are gathered only while that
    block runs. tp: ``tp_plan`` (``parallelize_module``'s), or the demo GPT's
    (``launch/tensor_parallel.py``) over the ``tp`` dim. 2d: that, then FSDP2 over ``dp``. hsdp:
    FSDP2 over the (``dp_replicate``, ``dp_shard``) mesh: sharded within, replicated across.
    """
    model = model.to(device)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if strategy == "pp":
        raise ValueError(
            "parallel=pp splits the model into stages: call ctx.pipeline(model, loss_fn) "
            "instead of ctx.parallelize(model); it returns the stage this rank runs"
        )
    if strategy in ("tp", "2d"):
        from launch.tensor_parallel import apply_tp

        assert mesh is not None, "the worker builds the mesh for parallel=tp and 2d"  # noqa: S101
        apply_tp(model, mesh["tp"], tp_plan)
    if strategy in ("fsdp", "2d", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # The demo's loop never modifies the logits in place, which is what this warns about.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        if mesh is None:  # a caller without the worker's mesh (fsdp only)
            import torch.distributed as dist

            mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
        dp_mesh = mesh["dp_replicate", "dp_shard"] if strategy == "hsdp" else mesh["dp"]
        for block in fsdp_blocks(model):
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
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
