"""Empty copies of state dicts, for DCP to load into before anything is applied.

DCP loads in place. Loading straight into the model's parameters would change the model before
the scaler agreement or a checksum could refuse the checkpoint; loading into copies shaped like
them (same sharding: DTensor placements, FSDP1 ShardedTensor shards) keeps every check ahead of
every change. The price is memory for one more copy of this rank's shard while loading.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["empty_copy"]


def _empty_tensor(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return DTensor.from_local(
            torch.empty_like(value.to_local()),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, ShardedTensor):
        shards = [
            Shard(torch.empty_like(s.tensor), copy.deepcopy(s.metadata))
            for s in value.local_shards()
        ]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards,
            sharded_tensor_metadata=copy.deepcopy(value.metadata()),
            process_group=value._process_group,
        )
    return torch.empty_like(value.detach())


def empty_copy(value: Any) -> Any:
    """``value`` with every tensor replaced by an uninitialized one of the same layout.

    Containers are copied; other leaves are kept (DCP replaces the ones it loads). The caller
    must make sure the checkpoint holds every key, or some tensors stay uninitialized.
    """
    if isinstance(value, torch.Tensor):
        return _empty_tensor(value)
    if isinstance(value, dict):
        return {k: empty_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [empty_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(empty_copy(v) for v in value)
    return value
