"""Refuse a save where several ranks write one key of the model or optimizer with other values.

DCP keeps one copy of an entry that several ranks save (a replicated tensor: DDP's params,
HSDP's replicas), on the assumption that the copies are equal. Pipeline stages built as their
own modules ("weight", "bias" on every stage) break it: both stages save ``model.weight``, one
is kept, and a resume loads it into both in silence. Each rank's plan carries a digest of each
such entry (shape, dtype, and the sum of its bits: one pass over the tensors, at save only,
one host read); the coordinator, which already gathers every plan, compares them and raises,
so the save fails on every rank and nothing is published.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

__all__ = ["CollidingEntriesError", "CheckedSavePlanner"]

_CHECKED = ("model.", "optimizer.")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class CollidingEntriesError(ValueError):
    """Several ranks save the same entry with other values (DCP would keep one of them)."""


def _bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor``'s bit patterns as int64 (wrapping): equal values, equal sums."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool or not (flat.is_floating_point() or flat.is_complex()):
        return flat.to(torch.int64).sum()
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(_BITS[flat.element_size()]).to(torch.int64).sum()


def _digests(state_dict: dict[str, Any], plan: SavePlan) -> dict[Any, Any]:
    """Each checked entry of ``plan``: (shape, dtype, bit sum), or the repr of a non-tensor."""
    keys, shapes, sums = [], [], []
    out: dict[Any, Any] = {}
    for item in plan.items:
        fqn = item.index.fqn
        if not fqn.startswith(_CHECKED):
            continue
        key = (fqn, None if item.index.offset is None else tuple(item.index.offset))
        value = state_dict.get(fqn)
        if item.type == WriteItemType.BYTE_IO:
            out[key] = repr(value)
            continue
        if hasattr(value, "local_shards") or not isinstance(value, torch.Tensor):
            continue  # a ShardedTensor's shards have their own offsets: never duplicated
        if hasattr(value, "to_local"):
            value = value.to_local()
        keys.append(key)
        shapes.append((tuple(value.shape), str(value.dtype)))
        sums.append(_bit_sum(value))
    if sums:  # one host read for all of them
        read = torch.stack([s.to(sums[0].device) for s in sums]).tolist()
        for key, shape, bit_sum in zip(keys, shapes, read, strict=True):
            out[key] = (*shape, bit_sum)
    return out


class CheckedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, refusing an entry that ranks save with other values."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        digests = _digests(self.state_dict, plan)
        return dataclasses.replace(plan, planner_data=(plan.planner_data, digests))

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        first: dict[Any, tuple[int, Any]] = {}
        differ: list[str] = []
        for rank, plan in enumerate(all_plans):
            for key, digest in plan.planner_data[1].items():
                seen = first.setdefault(key, (rank, digest))
                if seen[1] != digest and len(differ) < 3:
                    differ.append(f"{key[0]} (ranks {seen[0]} and {rank})")
        if differ:
            raise CollidingEntriesError(
                f"ranks save the same checkpoint entry with other values: {', '.join(differ)}; "
                "a checkpoint keeps one copy of an entry several ranks save, so the others' "
                "values would be lost on resume. Give each rank's modules the names they have "
                "in the whole model (pipeline stages: split one model, as torch.distributed."
                "pipelining does, instead of building each stage as its own module), or make "
                "the replicas equal (a DDP or HSDP replica that diverged)"
            )
        unwrapped = [dataclasses.replace(p, planner_data=p.planner_data[0]) for p in all_plans]
        return super().create_global_plan(unwrapped)
