"""The device mesh that ``parallel=`` asks for: its shape, its checks, and building it.

``mesh_shape`` is plain arithmetic on the config and the world size, so ``launch/validate.py``
checks a job's degrees before any worker starts, with the same rules the workers build by. The
dims are named as torchtitan names them: ``dp`` (FSDP2's shard dim, or DDP's), ``dp_replicate``
and ``dp_shard`` (HSDP), ``tp``, ``pp``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

#: The strategies whose model is split over ranks by a mesh of their own (not only dp).
MESH_STRATEGIES = ("tp", "2d", "hsdp", "pp")


class MeshError(ValueError):
    """The degrees in ``parallel.*`` do not fit the world size or the model; says which fix."""


def mesh_shape(parallel: dict[str, Any], world_size: int) -> dict[str, int]:
    """``{dim name: size}`` of the mesh for ``parallel`` on ``world_size`` ranks ({} for single).

    Raises:
        MeshError: a degree below 1, or degrees that do not multiply to ``world_size``.
    """
    strategy = str(parallel["strategy"])
    for key in ("tp", "replicate", "pp", "microbatches"):
        if int(parallel.get(key, 1)) < 1:
            raise MeshError(f"parallel.{key}={parallel[key]} must be >= 1")
    if strategy == "single":
        return {}
    if strategy in ("ddp", "fsdp"):
        return {"dp": world_size}
    if strategy == "tp":
        return {"tp": _whole("tp", int(parallel["tp"]), world_size, "parallel=2d")}
    if strategy == "pp":
        return {"pp": _whole("pp", int(parallel["pp"]), world_size, "a data-parallel dim")}
    inner_key = "tp" if strategy == "2d" else "replicate"
    inner = int(parallel[inner_key])
    if inner < 2 or world_size % inner or world_size // inner < 2:
        divisors = [d for d in range(2, world_size // 2 + 1) if world_size % d == 0]
        raise MeshError(
            f"parallel={strategy} parallel.{inner_key}={inner} must split the {world_size} ranks "
            f"into two mesh dims of at least 2 each: "
            + (
                f"use parallel.{inner_key}={' or '.join(map(str, divisors))}"
                if divisors
                else f"{world_size} rank(s) cannot; use 4 or more ranks"
            )
            + (", or parallel=tp" if strategy == "2d" else ", or parallel=fsdp / ddp")
        )
    outer = world_size // inner
    if strategy == "2d":
        return {"dp": outer, "tp": inner}
    return {"dp_replicate": inner, "dp_shard": outer}


def _whole(key: str, degree: int, world_size: int, other: str) -> int:
    if degree != world_size:
        raise MeshError(
            f"parallel.{key}={degree} but the job has {world_size} ranks: parallel={key} spans "
            f"every rank, so set parallel.{key}={world_size} or launcher.nproc_per_node="
            f"{degree} (combining {key} with {other} is not offered here)"
        )
    return degree


def check_model(parallel: dict[str, Any], shape: dict[str, int], model: dict[str, Any]) -> None:
    """The demo model must split as the mesh asks: heads and widths by tp, blocks by pp.

    ``model`` is the job's ``model`` node (name and sizes). Raises MeshError naming the fix.
    """
    strategy = str(parallel["strategy"])
    name = model["name"]
    if strategy in ("tp", "2d", "pp") and name != "gpt_small":
        raise MeshError(
            f"parallel={strategy} splits the demo GPT (its heads and MLP for tp, its blocks "
            f"for pp); model={name} has no such plan: use model=gpt_small"
        )
    tp = shape.get("tp", 1)
    if tp > 1:
        for key in ("n_heads", "d_model"):
            if model[key] % tp:
                raise MeshError(
                    f"parallel.tp={tp} splits the attention heads and the widths tp ways, but "
                    f"model.{key}={model[key]} is not divisible by {tp}: make model.{key} a "
                    f"multiple of {tp} or change parallel.tp"
                )
    pp = shape.get("pp", 1)
    if pp > 1 and model["n_layers"] % pp:
        raise MeshError(
            f"parallel.pp={pp} gives each stage model.n_layers / pp blocks, but model.n_layers="
            f"{model['n_layers']} is not divisible by {pp}: use a multiple of {pp} layers"
        )


def check_batches(parallel: dict[str, Any], batch_size: int) -> None:
    """``parallel=pp``: microbatches split ``data.batch_size`` evenly, at least one per stage."""
    if str(parallel["strategy"]) != "pp":
        return
    n, pp = int(parallel["microbatches"]), int(parallel["pp"])
    if batch_size % n:
        raise MeshError(
            f"parallel.microbatches={n} must divide data.batch_size={batch_size} (each "
            "microbatch is an equal slice of the batch): change one of them"
        )
    if parallel["schedule"] == "1f1b" and n < pp:
        raise MeshError(
            f"parallel.schedule=1f1b needs parallel.microbatches >= parallel.pp ({n} < {pp}): "
            f"use parallel.microbatches={pp} or more"
        )


def build_mesh(
    parallel: dict[str, Any], world_size: int, device: torch.device
) -> DeviceMesh | None:
    """The job's DeviceMesh on every rank (a collective: all ranks call it together); None for
    ``single``."""
    shape = mesh_shape(parallel, world_size)
    if not shape:
        return None
    return init_device_mesh(device.type, tuple(shape.values()), mesh_dim_names=tuple(shape))


def data_parallel(mesh: DeviceMesh | None) -> tuple[int, int]:
    """(this rank's index among the data-parallel replicas, their number).

    Ranks of one tensor-parallel group or one pipeline see the same batch; every rank of a
    ``dp``, ``dp_replicate`` x ``dp_shard`` mesh sees its own.
    """
    if mesh is None:
        return 0, 1
    names = mesh.mesh_dim_names or ()
    dims = [n for n in names if n.startswith("dp")]
    if not dims:
        return 0, 1
    index, size = 0, 1
    for name in dims:
        index = index * mesh[name].size() + mesh[name].get_local_rank()
        size *= mesh[name].size()
    return index, size
