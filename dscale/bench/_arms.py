"""The contenders: a plain optimizer step and the same step through each scaler.

Every scaler starts at the same scale (2**16) and sees gradients that were scaled by it, so each
one does its full job (check, unscale, decide, update) and no step is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import dscale

INIT_SCALE = 2.0**16
OPTIMIZERS = ("sgd", "adam")
IMPLS = ("foreach", "fused")
SCALERS = ("dscale", "torch", "sharded")
# An arm named "<scaler>_aa" is a second, independent copy of that scaler: the A/A arm, whose
# ratio to the first copy shows what plain noise does to a ratio in the same run.
AA_SUFFIX = "_aa"
# "<scaler>_unscaled" calls ``unscale_()`` before ``step()``. For ShardedGradScaler with a fused
# optimizer this is what makes the ranks agree: its fused path skips the all-reduce (torch 2.13),
# so one rank's inf is skipped on that rank only. With it, it makes dscale's one collective.
UNSCALE_SUFFIX = "_unscaled"
# Not a scaler anyone ships: the least work any scaler that keeps torch's numbers must do.
FLOOR = "floor"
# dscale on the device-side decision path (as on CUDA, forced on the CPU): plain, sync_free and
# predictive. On CUDA the first is what "dscale" runs anyway for a fused optimizer.
DEVICE_PATH_ARMS = ("dscale_device", "dscale_sync_free", "dscale_predictive")


def make_optimizer(
    params: Sequence[torch.nn.Parameter], kind: str, impl: str
) -> torch.optim.Optimizer:
    """SGD or Adam, foreach or fused; a tiny lr keeps repeated steps on scaled grads finite."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {kind!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    flags: dict[str, Any] = {"foreach": True} if impl == "foreach" else {"fused": True}
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-9, momentum=0.9, **flags)
    return torch.optim.Adam(params, lr=1e-9, **flags)


def make_scaler(name: str, device: torch.device) -> Any:
    """A scaler by arm name with its scale already initialised (as the first scale() call does)."""
    name = name.removesuffix(AA_SUFFIX).removesuffix(UNSCALE_SUFFIX)
    if name == FLOOR:
        return FloorScaler(device)
    if name == "dscale":
        scaler: Any = dscale.GradScaler(device.type, init_scale=INIT_SCALE)
    elif name in DEVICE_PATH_ARMS:
        # The device-side decision a CUDA run takes, forced on the CPU (dscale.bench._ops).
        scaler = dscale.GradScaler(
            device.type,
            init_scale=INIT_SCALE,
            sync_free=name == "dscale_sync_free",
            policy="predictive" if name == "dscale_predictive" else "dynamic",
        )
        scaler._read_host_flags = False
    elif name == "torch":
        scaler = torch.amp.GradScaler(device.type, init_scale=INIT_SCALE)
    elif name == "sharded":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device=device.type, init_scale=INIT_SCALE)
    else:
        raise ValueError(f"scaler must be one of {SCALERS}, got {name!r}")
    scaler.scale(torch.ones((), device=device))
    return scaler


def scaler_step(
    scaler: Any, optimizer: torch.optim.Optimizer, *, unscale_first: bool = False
) -> Callable[[], None]:
    """The timed body of a scaler arm: step + update (after ``unscale_()`` if asked)."""

    def run() -> None:
        if unscale_first:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()

    return run


class FloorScaler:
    """The floor of a scaler's overhead: the work no scaler can drop and keep torch's numbers.

    One ``_amp_foreach_non_finite_check_and_unscale_`` over the grads (the pass torch's scalers
    make: it unscales as it checks), a one-float all-reduce of the flag when there are several
    ranks, and the decision; nothing else: no grouping, no checks of the input, no scale update,
    no state. A fused optimizer gets the flag and decides on the device, as with torch.
    ``floor / peer`` is the lowest ratio against that peer any such scaler could reach.
    """

    def __init__(
        self, device: torch.device, init_scale: float = INIT_SCALE, agree: bool | None = None
    ) -> None:
        self._init_scale = init_scale
        self._inv_scale = torch.full((), 1.0 / init_scale, device=device)
        self._found = torch.zeros((), device=device)
        # All-reduce the flag: by default when there are several ranks.
        self._agree = (
            dist.is_initialized() and dist.get_world_size() > 1 if agree is None else agree
        )

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs * self._init_scale

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        self._found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, self._found, self._inv_scale)
        if self._agree:
            dist.all_reduce(self._found)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.found_inf = self._found  # type: ignore[attr-defined]
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            optimizer.step()
            del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]
        elif not self._found.item():
            optimizer.step()

    def update(self) -> None:
        """The scale stays: a growth every 2000 steps costs nothing that counts."""
