"""Skip an optimizer step on the device instead of on the host (``GradScaler(sync_free=True)``).

The optimizer always runs; afterwards every parameter and optimizer-state tensor is put back to its
value from before the step wherever the agreed overflow flag is set. No ``.item()``, so foreach and
plain optimizers step without a host sync. The price is a copy of the parameters and the optimizer
state per step (memory: one extra copy of both; time: one read and two writes of each).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _stepped_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            out.append(param)
            for value in optimizer.state.get(param, {}).values():
                if isinstance(value, torch.Tensor):
                    out.append(value)
    return out


def masked_step(
    optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, run_step: Callable[[], Any]
) -> Any:
    """Run ``run_step()`` and undo its effect on the device where ``found_inf > 0``."""
    with torch.no_grad():
        before = {id(t): t.clone() for t in _stepped_tensors(optimizer)}
    result = run_step()
    with torch.no_grad():
        skip_on: dict[torch.device, torch.Tensor] = {}
        for tensor in _stepped_tensors(optimizer):
            dev = tensor.device
            if dev not in skip_on:
                skip_on[dev] = found_inf.to(dev, non_blocking=True) > 0
            old = before.get(id(tensor))
            # State created by this very step (lazy init) goes back to "fresh": zeros.
            restored = old if old is not None else torch.zeros_like(tensor)
            tensor.copy_(torch.where(skip_on[dev], restored, tensor))
    return result


def params_without_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters whose optimizer state the next step will create (none once all have state)."""
    if len(optimizer.state) >= sum(len(g["params"]) for g in optimizer.param_groups):
        return []  # the common case after the first step: no Python loop over the parameters
    return [
        p for group in optimizer.param_groups for p in group["params"] if p not in optimizer.state
    ]


def reset_state_created_by_skipped_step(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], found_inf: torch.Tensor
) -> None:
    """Zero the state a skipped fused step created (``torch.empty`` garbage), on the device.

    torch's fused SGD allocates its momentum buffer uninitialised on the first step and leaves it
    so when ``found_inf`` skips that step; every later step then reads the garbage. "step"
    counters are left alone: the fused kernels already undo their increment.
    """
    with torch.no_grad():
        for param in params:
            for key, value in optimizer.state.get(param, {}).items():
                if key != "step" and isinstance(value, torch.Tensor):
                    skip = found_inf.to(value.device, non_blocking=True) > 0
                    value.copy_(torch.where(skip, torch.zeros_like(value), value))
