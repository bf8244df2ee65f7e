"""Unscale inside the gradient reduction: ``GradScaler.attach(ddp_model or fsdp2_model)``.

DDP's default hook divides each bucket by the world size and all-reduces it. This hook all-reduces
the scaled bucket and then, in one fused pass over the reduced values, multiplies by
1 / (world_size * scale) and records whether any value is inf/NaN. The reduced bucket is the same on
every rank, so the flag is already global: the scaler needs no separate unscale pass and no
collective of its own for these parameters.

fp16/bf16 buckets are divided by the world size before the all-reduce (as DDP does) so the sum
cannot overflow where the average would not; the pass after it then multiplies by 1 / scale.
For a power-of-two world size and scale (dscale's defaults), the result is bitwise the plain path's.

FSDP2 has no replaceable reduce-scatter hook that sees the whole reduction, but it runs
``set_all_reduce_hook`` callbacks on every reduce-scatter output while it is hot; there this module
unscales and checks the rank's shard in one pass. A shard's flag is local, so the scaler still
all-reduces it (one element), but step() no longer makes its own pass over those grads.
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations as objects.
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dscale._grad_measure import GradMeasure


class HookState:
    """Per-scaler state the hook shares with the scaler: the flag of the current backward."""

    def __init__(
        self,
        scale_of: Callable[[], torch.Tensor],
        group: Any,
        *,
        flag_is_global: bool,
        measure: GradMeasure | None = None,
    ) -> None:
        self.scale_of = scale_of
        self.measure = measure  # policy="predictive": also measure the reduced, unscaled grads
        self.group = group
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.flag_is_global = flag_is_global
        self.found: dict[torch.device, torch.Tensor] = {}

    def flag(self, device: torch.device) -> torch.Tensor:
        if device not in self.found:
            self.found[device] = torch.zeros((), dtype=torch.float32, device=device)
        return self.found[device]

    def take_flags(self) -> list[torch.Tensor]:
        """The flags recorded since the last call (empty: no bucket was reduced)."""
        flags = list(self.found.values())
        self.found = {}
        return flags


def unscale_allreduce_hook(
    state: HookState,
    bucket: dist.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: all-reduce the bucket, then average, unscale and check it in one pass."""
    buffer = bucket.buffer()
    scale = state.scale_of().to(buffer.device, non_blocking=True)
    low_precision = buffer.dtype in (torch.float16, torch.bfloat16)
    if low_precision:
        buffer.div_(state.world_size)
        inv = scale.double().reciprocal().float()
    else:
        inv = (scale.double() * state.world_size).reciprocal().float()
    found = state.flag(buffer.device)
    work = dist.all_reduce(buffer, group=state.group, async_op=True)

    def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
        reduced = fut.value()[0]
        torch._amp_foreach_non_finite_check_and_unscale_([reduced], found, inv)
        if state.measure is not None:
            state.measure.add([reduced], torch.ones_like(scale), scale)
        return reduced

    return work.get_future().then(finish)


def unscale_reduced_shard(state: HookState, reduce_output: torch.Tensor) -> None:
    """FSDP2 all-reduce hook: unscale and check this rank's reduce-scatter output in place."""
    scale = state.scale_of().to(reduce_output.device, non_blocking=True)
    inv = scale.double().reciprocal().float()
    torch._amp_foreach_non_finite_check_and_unscale_(
        [reduce_output], state.flag(reduce_output.device), inv
    )
    if state.measure is not None:
        state.measure.add([reduce_output], torch.ones_like(scale), scale)


class ReductionHooks:
    """The models a scaler is attached to, and the flag their hooks recorded this iteration."""

    def __init__(self) -> None:
        self.states: list[HookState] = []
        self.params: set[int] = set()
        self._flag: torch.Tensor | None = None

    def attach(
        self,
        model: torch.nn.Module,
        scale_of: Callable[[], torch.Tensor],
        measure: GradMeasure | None = None,
    ) -> None:
        """Register the hook that fits ``model`` (DDP or FSDP2); TypeError for anything else."""
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            state = HookState(scale_of, model.process_group, flag_is_global=True, measure=measure)
            model.register_comm_hook(state, unscale_allreduce_hook)
        elif isinstance(model, FSDPModule):
            state = HookState(scale_of, None, flag_is_global=False, measure=measure)
            for unit in model.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_all_reduce_hook(functools.partial(unscale_reduced_shard, state))
        else:
            raise TypeError(
                "attach() takes a DistributedDataParallel model or an FSDP2 (fully_shard) model, "
                f"got {type(model).__name__}; other models need no attach()"
            )
        self.states.append(state)
        self.params |= {id(p) for p in model.parameters() if p.requires_grad}

    def take_flag(self, device: torch.device) -> torch.Tensor | None:
        """This iteration's flag (kept for every optimizer); None when no hook ran since reset."""
        if self._flag is None and self.states:
            flags = [f for s in self.states for f in s.take_flags()]
            if flags:
                self._flag = torch.stack([f.to(device) for f in flags]).sum()
        return self._flag

    def reset(self) -> None:
        """Forget this iteration's flag (update() calls it)."""
        self._flag = None

    def flag_is_global_for(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the hooks' flag alone is already the same on every rank for ``optimizer``.

        True only for DDP hooks covering all its parameters: decided from the parameter sets,
        which every rank shares, never from local grads.
        """
        return all(s.flag_is_global for s in self.states) and all(
            id(p) in self.params for g in optimizer.param_groups for p in g["params"]
        )
