"""The checkpoint package's collectives: rank facts, barrier, and gather-then-raise.

Everything here is a no-op with one process, so single-process code paths run in plain tests.
Collectives outside DCP itself go through this module only.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "all_gather",
    "all_gather_floats",
    "barrier",
    "gather_then_raise",
    "is_distributed",
    "quiet_single_process",
    "rank",
    "world_size",
]


def is_distributed(group: ProcessGroup | None) -> bool:
    """True when a process group is initialized (any world size)."""
    return dist.is_available() and dist.is_initialized()


def rank(group: ProcessGroup | None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if is_distributed(group) else 0


def world_size(group: ProcessGroup | None) -> int:
    """The number of ranks in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if is_distributed(group) else 1


def barrier(group: ProcessGroup | None) -> None:
    """Wait for every rank of ``group``."""
    if is_distributed(group):
        dist.barrier(group=group)


def all_gather(value: Any, group: ProcessGroup | None) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, on every rank.

    Uses pickle over the process group, which DCP also does: ranks of one job trust each other.
    """
    if not is_distributed(group):
        return [value]
    out: list[Any] = [None] * world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def all_gather_floats(values: Sequence[float], group: ProcessGroup | None) -> list[list[float]]:
    """Every rank's list of floats (same length on every rank), without pickling."""
    local = torch.tensor(list(values), dtype=torch.float64)
    if not is_distributed(group):
        return [local.tolist()]
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    if device is not None:
        local = local.to(device)
    out = [torch.empty_like(local) for _ in range(world_size(group))]
    dist.all_gather(out, local, group=group)
    return [t.cpu().tolist() for t in out]


def gather_then_raise(problem: BaseException | None, group: ProcessGroup | None, what: str) -> None:
    """Raise the same error on every rank if any rank has a problem, naming the ranks.

    A check that can fail on one rank only (a corrupt shard, a file one rank cannot read) must
    not raise on that rank alone, or the others hang in their next collective.
    """
    mine = None if problem is None else (type(problem).__name__, str(problem))
    bad = [(r, p) for r, p in enumerate(all_gather(mine, group)) if p is not None]
    if not bad:
        return
    ranks = ", ".join(str(r) for r, _ in bad)
    detail = "; ".join(f"rank {r}: {msg}" for r, (_, msg) in bad)
    cls = _error_type(bad[0][1][0])
    raise cls(f"{what} failed on rank(s) {ranks}: {detail}") from problem


def _error_type(name: str) -> type[Exception]:
    """The exception class a rank reported, when it is one of ours; else RuntimeError."""
    from dscale.checkpoint import _errors

    cls = getattr(_errors, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, Exception) else RuntimeError


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" warning.

    It fires on every call even with ``no_dist=True``; without a process group that is
    exactly what we mean.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
