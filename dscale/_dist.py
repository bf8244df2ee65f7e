"""Which process group the scaler agrees over, and on which device its flag is reduced.

This is the one place (with ``_agreement.py``) that knows about ``torch.distributed``. With a single
process every answer is "no group", so every scaler code path runs in a plain unit test.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when a default process group with more than one rank exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def resolve_group(group: Any | None) -> Any | None:
    """The group to agree over: ``group``, else the world group when distributed, else None."""
    if group is not None:
        return group
    return dist.group.WORLD if is_distributed() else None


def group_ranks(group: Any | None) -> list[int] | None:
    """Global ranks of ``group`` (None for the default group), so a pickled scaler can find it."""
    if group is None or group is dist.group.WORLD:
        return None
    return list(dist.get_process_group_ranks(group))


def group_covers(outer: Any | None, inner: Any | None) -> bool:
    """Whether every rank of ``inner`` is in ``outer`` (None: the default group, or no group)."""
    if inner is None and not is_distributed():
        return True
    outer_ranks = (
        set(range(dist.get_world_size()))
        if outer is None
        else set(dist.get_process_group_ranks(outer))
    )
    inner_ranks = (
        set(range(dist.get_world_size()))
        if inner is None
        else set(dist.get_process_group_ranks(inner))
    )
    return inner_ranks <= outer_ranks


def find_group(ranks: list[int] | None) -> Any | None:
    """The existing process group over exactly ``ranks``; None means the default group."""
    if ranks is None:
        return None
    if not dist.is_initialized():
        raise RuntimeError(
            f"this GradScaler was pickled with a process group over ranks {ranks}, but "
            "torch.distributed is not initialized here; call init_process_group and create "
            "that group before using the unpickled scaler"
        )
    from torch.distributed.distributed_c10d import _world

    for pg, mapping in _world.pg_group_ranks.items():
        if sorted(mapping) == sorted(ranks):
            return pg
    raise RuntimeError(
        f"this GradScaler was pickled with a process group over ranks {ranks}; no such group "
        "exists in this process: create it with dist.new_group(ranks) first"
    )


def _backend_device_types(group: Any) -> set[str]:
    try:
        return {torch.device(d).type for d in group._device_types}
    except (AttributeError, RuntimeError):
        backend = str(dist.get_backend(group)).lower()
        types = {part.split(":")[0] for part in backend.split(",") if ":" in part}
        if "nccl" in backend:
            types.add("cuda")
        if "gloo" in backend or "mpi" in backend:
            types.add("cpu")
        return types


def flag_device(group: Any, preferred: torch.device) -> torch.device:
    """Device on which ``group``'s backend reduces the flag, ``preferred`` when it can.

    NCCL reduces CUDA tensors only, gloo CPU tensors (gloo's CUDA path stages through the host).
    Grads that live on the CPU (FSDP CPU offload) under NCCL therefore send their flag to the GPU.
    """
    types = _backend_device_types(group)
    if preferred.type in types:
        return preferred
    if "cuda" in types and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
