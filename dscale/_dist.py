"""Process groups and the collectives dscale runs outside the scaler's hot path.

This is the one place (with ``_agreement.py``) that knows about ``torch.distributed``: which group
the scaler agrees over and on which device its flag is reduced, and the rank facts, barriers,
gathers and broadcasts that checkpoints and preemption use. With a single process (or a group of
one rank) every collective is a no-op, so every code path runs in a plain unit test.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def is_distributed(group: Any | None = None) -> bool:
    """True when torch.distributed is initialized and ``group`` (default: world) has > 1 rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


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


# (group, preferred, device) answers of flag_device, made eagerly: dynamo cannot read the
# backend off a ProcessGroup (an internal error even without fullgraph), so a compiled step
# finds the answer its eager warm-up step made. The group is held weakly: a strong reference
# kept it (and its gloo threads) alive after the user's destroy_process_group(), until the
# interpreter's own teardown, where gloo's threads could abort the process at exit
# ("terminate called without an active exception").
_FLAG_DEVICES: list[tuple[weakref.ref[Any], torch.device, torch.device]] = []


def flag_device(group: Any, preferred: torch.device) -> torch.device:
    """Device on which ``group``'s backend reduces the flag, ``preferred`` when it can.

    NCCL reduces CUDA tensors only, gloo CPU tensors (gloo's CUDA path stages through the host).
    Grads that live on the CPU (FSDP CPU offload) under NCCL therefore send their flag to the GPU.
    """
    for known, asked, device in _FLAG_DEVICES:
        if known() is group and asked == preferred:
            return device
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "torch.compile around scaler.step(): this process group's backend was not read "
            "eagerly yet; run the first step(s) outside the compiled function (warm-up)"
        )
    types = _backend_device_types(group)
    if preferred.type in types:
        device = preferred
    elif "cuda" in types and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    _FLAG_DEVICES[:] = [entry for entry in _FLAG_DEVICES if entry[0]() is not None]
    if len(_FLAG_DEVICES) >= 16:  # groups come and go in tests: keep the newest
        del _FLAG_DEVICES[0]
    _FLAG_DEVICES.append((weakref.ref(group), preferred, device))
    return device


# ------------------------------------------------------------------ rank facts and collectives
# Each is a no-op without a process group or with a group of one rank.


def rank(group: Any | None = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if is_distributed(group) else 0


def world_size(group: Any | None = None) -> int:
    """The number of ranks in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if is_distributed(group) else 1


def barrier(group: Any | None = None) -> None:
    """Wait for every rank of ``group``."""
    if is_distributed(group):
        dist.barrier(group=group)


def all_gather_objects(value: Any, group: Any | None = None) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, on every rank.

    Pickled over the process group, as DCP does: the ranks of one job trust each other.
    """
    if not is_distributed(group):
        return [value]
    out: list[Any] = [None] * world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def broadcast_object(value: Any, group: Any | None = None, src_rank: int = 0) -> Any:
    """``value`` as rank ``src_rank`` of ``group`` holds it, on every rank."""
    if not is_distributed(group):
        return value
    box = [value]
    src = dist.get_global_rank(group, src_rank) if group is not None else src_rank
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_floats(values: Sequence[float], group: Any | None = None) -> list[list[float]]:
    """Every rank's list of floats (same length on every rank), without pickling."""
    local = torch.tensor(list(values), dtype=torch.float64)
    if not is_distributed(group):
        return [local.tolist()]
    device = flag_device(resolve_group(group), torch.device("cpu"))
    local = local.to(device)
    out = [torch.empty_like(local) for _ in range(world_size(group))]
    dist.all_gather(out, local, group=group)
    return [t.cpu().tolist() for t in out]


def any_rank(flag: bool, group: Any | None = None) -> bool:
    """True on every rank when ``flag`` is True on any rank (a MAX all-reduce on the CPU).

    ``group`` must reduce CPU tensors (gloo): see :func:`cpu_group`. No GPU stream is involved,
    so calling this once per step adds no host-device sync.
    """
    if not is_distributed(group):
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


# Held weakly, as _FLAG_DEVICES: torch's registry keeps a group alive until it is destroyed.
_cpu_groups: dict[tuple[int, ...], weakref.ref[Any]] = {}


def cpu_group(group: Any | None = None) -> Any | None:
    """A group over ``group``'s ranks whose backend reduces CPU tensors; made once, by every rank.

    ``group`` itself when its backend handles CPU tensors (gloo), else a new gloo group over the
    same ranks (NCCL reduces CUDA tensors only). Every rank must call this at the same point the
    first time, since creating a group is a collective.
    """
    if not is_distributed(group):
        return None
    resolved = resolve_group(group)
    if "cpu" in _backend_device_types(resolved):
        return resolved
    ranks = tuple(dist.get_process_group_ranks(resolved))
    known = _cpu_groups.get(ranks)
    made = None if known is None else known()
    if made is None:  # first call, or the group was destroyed since: every rank sees the same
        made = dist.new_group(ranks=list(ranks), backend="gloo")
        _cpu_groups[ranks] = weakref.ref(made)
    return made


def new_gloo_group(group: Any | None = None) -> Any | None:
    """A new gloo group over ``group``'s ranks, for collectives run from a background thread.

    On the training group they would interleave with DDP's all-reduces in a different order on
    each rank and hang (seen with DDP on gloo); torchtitan does the same for async saves.
    Creating a group is a collective: every rank calls this at the same point.
    """
    if not is_distributed(group):
        return None
    ranks = dist.get_process_group_ranks(resolve_group(group))
    return dist.new_group(ranks=ranks, backend="gloo")


def gather_then_raise(
    problem: BaseException | None,
    group: Any | None,
    what: str,
    error_types: Sequence[type[Exception]] = (),
) -> None:
    """Raise the same error on every rank if any rank has a problem, naming the ranks.

    A check that can fail on one rank only (a corrupt shard, a file one rank cannot read) must
    not raise on that rank alone, or the others hang in their next collective. The error's
    type is the first of ``error_types`` that some rank raised (so list them by priority);
    else RuntimeError.
    """
    mine = None if problem is None else (type(problem).__name__, str(problem))
    bad = [(r, p) for r, p in enumerate(all_gather_objects(mine, group)) if p is not None]
    if not bad:
        return
    names = {name for _, (name, _) in bad}
    cls = next((c for c in error_types if c.__name__ in names), RuntimeError)
    messages: dict[str, list[int]] = {}
    for r, (_, msg) in bad:
        messages.setdefault(msg, []).append(r)
    if len(messages) == 1 and len(bad) == world_size(group):
        raise cls(bad[0][1][1]) from problem  # one message, already about every rank
    ranks = ", ".join(str(r) for r, _ in bad)
    detail = "; ".join(
        f"rank {r[0]}: {msg}" if len(r) == 1 else f"ranks {', '.join(map(str, r))}: {msg}"
        for msg, r in messages.items()
    )
    raise cls(f"{what} failed on rank(s) {ranks}: {detail}") from problem


def sum_partial(grad: Any) -> Any:
    """``grad`` (a DTensor) with every ``Partial`` mesh dim summed into ``Replicate``.

    DTensor's own ``redistribute``: the all-reduce an optimizer's op would run on that grad.
    A grad with no Partial dim is returned as it is.
    """
    placements = grad.placements
    if not any(p.is_partial() for p in placements):
        return grad
    from torch.distributed.tensor import Replicate

    summed = [Replicate() if p.is_partial() else p for p in placements]
    return grad.redistribute(grad.device_mesh, summed)
