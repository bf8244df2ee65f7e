"""One save: write into the temp folder, and on any failure remove it and say what it needed.

A failed save (a full disk, a read-only folder, one rank's error) raises CheckpointSaveError on
every rank, after the coordinator has removed the unfinished folder; published checkpoints are
never touched. The message says how much space the checkpoint needed and how much was free.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from dscale import _dist
from dscale.checkpoint._errors import CheckpointSaveError, describe_failure
from dscale.checkpoint._hashing import HashingWriter
from dscale.checkpoint._publish import remove_temp_dirs
from dscale.checkpoint._quiet import quiet_single_process

__all__ = [
    "check_directory",
    "format_bytes",
    "local_bytes",
    "prepare_folder",
    "raise_if_failed",
    "write",
]

_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest unit that keeps it >= 1 (GB are 10**9 bytes)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # unreachable; keeps mypy content


def local_bytes(states: Mapping[str, Any]) -> int:
    """Bytes of tensor data this rank writes for ``states`` (its shards only)."""
    total = 0
    flat, _ = flatten_state_dict({k: v.state_dict() for k, v in states.items()})
    for value in flat.values():
        if hasattr(value, "to_local"):
            value = value.to_local()
        elif hasattr(value, "local_shards"):
            total += sum(s.tensor.nbytes for s in value.local_shards())
            continue
        if isinstance(value, torch.Tensor):
            total += value.nbytes
    return total


def _free_bytes(root: Path) -> int | None:
    for folder in (root, *root.parents):
        if folder.exists():
            return shutil.disk_usage(folder).free
    return None


def check_directory(
    root: Path, needed: int | None = None, *, what: str = "one checkpoint needs"
) -> str | None:
    """What stops a save into ``root``, in words (None if nothing): it cannot be created or
    written (a small file is created and removed), or has less than ``needed`` bytes free
    (``what`` says what needs them).

    Run before training, so a folder that cannot take a checkpoint fails before the first save
    instead of after all the training before it.
    """
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".dscale-write-test-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return (
            f"checkpoint folder {root} is not writable ({type(exc).__name__}: {exc}); nothing "
            "was trained. Pass a checkpoint directory this job can create and write (on a "
            "filesystem every node shares), or fix its permissions"
        )
    free = _free_bytes(root)
    if needed is not None and free is not None and free < needed:
        return (
            f"checkpoint folder {root} has {format_bytes(free)} free, but {what} "
            f"about {format_bytes(needed)} of tensor data; nothing was trained. Free space "
            "there or pass a checkpoint directory on a larger filesystem"
        )
    return None


def prepare_folder(root: Path, is_coordinator: bool) -> BaseException | None:
    """Create ``root`` and clear crashed temp folders (coordinator); return the error, if any."""
    if not is_coordinator:
        return None
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_temp_dirs(root)
    except OSError as exc:
        return exc
    return None


def write(
    states: dict[str, Any],
    tmp: Path,
    *,
    step: int,
    group: ProcessGroup | None,
    async_group: ProcessGroup | None,
    use_async: bool,
) -> tuple[Future[Any] | None, BaseException | None]:
    """Write ``states`` into ``tmp``: (the async future, or None; the error, or None)."""
    writer = HashingWriter(tmp, step=step, world_size=_dist.world_size(group))
    no_dist = not _dist.is_distributed(group)
    try:
        with quiet_single_process():
            if use_async:
                future = dcp_async_save(
                    states, storage_writer=writer, process_group=async_group, no_dist=no_dist
                )
                return future, None  # type: ignore[return-value]
            dcp_save(states, storage_writer=writer, process_group=group, no_dist=no_dist)
    except CheckpointException as exc:
        return None, exc
    except OSError as exc:
        return None, exc
    return None, None


def _cause(problem: BaseException) -> OSError | None:
    """The OSError under ``problem`` (DCP wraps each rank's error), if there is one."""
    failures = getattr(problem, "failures", None)
    errors = [f[0] for f in failures.values()] if isinstance(failures, dict) else [problem]
    for error in errors:
        seen: BaseException | None = error
        while seen is not None:
            if isinstance(seen, OSError):
                return seen
            seen = seen.__cause__ or seen.__context__
    return None


def raise_if_failed(
    problem: BaseException | None,
    states: Mapping[str, Any],
    *,
    root: Path,
    tmp: Path,
    step: int,
    group: ProcessGroup | None,
) -> None:
    """Raise CheckpointSaveError on every rank if any rank failed; remove ``tmp`` first.

    Collective: every rank calls it after the write, so no rank is still writing when the
    coordinator removes the folder.
    """
    mine = None if problem is None else describe_failure(problem)
    reports = _dist.all_gather_objects(mine, group)
    if all(r is None for r in reports):
        return
    needed = sum(_dist.all_gather_objects(local_bytes(states), group))
    if _dist.rank(group) == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    free = _free_bytes(root)
    cause = _cause(problem) if problem is not None else None
    failed = [f"rank {r}: {msg}" for r, msg in enumerate(reports) if msg is not None]
    advice = "free space on that filesystem or point the checkpoint directory elsewhere"
    if cause is not None and cause.errno in _NOT_WRITABLE:
        advice = f"{root} is not writable: pass a checkpoint directory this job can write to"
    free_text = "unknown" if free is None else format_bytes(free)
    raise CheckpointSaveError(
        f"saving step {step} into {tmp} failed ({'; '.join(failed)}). The checkpoint needs "
        f"about {format_bytes(needed)} of tensor data and {root} has {free_text} free; "
        f"{advice}. The unfinished folder was removed and the previous checkpoints are kept"
    ) from problem
