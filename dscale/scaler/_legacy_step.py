"""torch's older contract: ``optimizer.step(grad_scaler=scaler)``, where the optimizer checks.

Such an optimizer (apex's and Transformer Engine's capturable fused ones) asks the scaler
``_check_inf_per_device(optimizer)`` (or calls ``unscale_``) and ``_get_scale_async()``, then
unscales and skips in its own kernel. What it reads here is the flag agreed by every rank, so
every rank's optimizer skips alike; a read of the flag outside such a step (it may come from one
rank only) checks this rank's grads and starts no collective, as torch's scaler does.
"""

from __future__ import annotations

import inspect
import math
import types
import warnings
import weakref
from typing import Any, Protocol

import torch

from dscale.scaler import _check, _decision
from dscale.scaler._program.masked_step import (
    ids_with_state,
    remove_state_created_by_skipped_step,
    state_created_since,
)
from dscale.scaler._program.unscale import group_by_device_and_dtype, optimizer_grads
from dscale.scaler._stage import OptimizerState, Stage


class Scaler(_check.Scaler, _decision.Scaler, Protocol):
    """What torch's older contract reads and writes of the scaler, beyond the check's and the
    decision's (``GradScaler`` is one; nothing here imports it)."""

    _scale_for_step: torch.Tensor | None
    _stepping: int | None
    _outcomes: dict[int, bool | torch.Tensor]

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, Any]: ...


def step_passing_scaler(
    scaler: Scaler,
    optimizer: torch.optim.Optimizer,
    state: OptimizerState,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run ``optimizer.step(grad_scaler=scaler)``; its outcome is recorded as any step's."""
    warnings.warn(
        "GradScaler is going to stop passing itself as a keyword argument to the passed "
        "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
        "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
        FutureWarning,
        stacklevel=4,
    )
    before = ids_with_state(optimizer)
    # attach(): the hooks unscaled grads in the reduction (and the check unscales the rest to
    # match). Check now, whatever order the optimizer asks in, so that it reads a scale of 1
    # from _get_scale_async() instead of dividing a second time.
    scale = scaler._require_scale("step")
    if state.agreed is None and scaler._hooks.reduced(optimizer):
        unscaled = _check.check(scaler, optimizer, state, unscale=False)
        assert unscaled  # noqa: S101 - the hooks reduced: the check unscales what they did not
        state.prechecked = True  # an unscale_() from the optimizer has nothing left to do
        scaler._scale_for_step = scaler._factors.one(scale)
    if state.stage is Stage.UNSCALED and state.agreed is not None:
        _decision.refuse_a_backward_since_unscale(scaler, optimizer, state)  # as step() does
    step: Any = optimizer.step  # takes grad_scaler= (checked by takes_grad_scaler)
    scaler._stepping = id(optimizer)
    try:
        retval = step(*args, grad_scaler=scaler, **kwargs)
    finally:
        scaler._scale_for_step = None
        scaler._stepping = None
    if state.agreed is None:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(grad_scaler=...) never checked its grads: it "
            "must call grad_scaler._check_inf_per_device(optimizer) or "
            "grad_scaler.unscale_(optimizer), so that update() knows whether it skipped"
        )
    flag = _decision.overflow_flag(scaler, state)
    fresh = state_created_since(optimizer, before)
    if fresh:
        remove_state_created_by_skipped_step(optimizer, fresh, flag)
    on_host = scaler._decides_on_host(flag)
    scaler._outcomes[id(optimizer)] = _decision.decide_on_host(scaler, state) if on_host else flag
    return retval


def agree_now(scaler: Scaler, optimizer: torch.optim.Optimizer) -> None:
    """Start the agreement that unscale_() left for later, where every rank reads the flag.

    That is inside ``optimizer``'s step(grad_scaler=...) (it reads the flag it skips on).
    Elsewhere a read may come from one rank only (a log line on rank 0): started there
    alone, the all-reduce would pair with the peers' next collective (a user's
    clip_grad_norm_ before step()) and the ranks would hang. It gets this rank's flag then,
    as from torch's scaler, and the ranks agree in step() or update().
    """
    if scaler._stepping != id(optimizer):
        return
    state = scaler._per_optimizer_states.get(id(optimizer))
    if state is not None and state.deferred:
        _decision.start_deferred(scaler, state)


def check_inf_per_device(scaler: Scaler, optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
    """torch's check without unscaling: ``{device: flag}``, agreed inside the optimizer's step.

    Called elsewhere (it may be on one rank only), it checks this rank's grads, as torch's
    does, and changes nothing the step will do: a collective started there alone would leave
    the ranks' collectives out of step.
    """
    scaler._require_scale("_check_inf_per_device")
    state = scaler._per_optimizer_states.get(id(optimizer))
    if scaler._stepping != id(optimizer) and (state is None or state.agreed is None):
        return _local_flags(optimizer)
    state = scaler._per_optimizer_states.setdefault(id(optimizer), OptimizerState())
    if state.agreed is None:
        _check.check(scaler, optimizer, state, unscale=False)
    return scaler._found_inf_per_device(optimizer)


def _local_flags(optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
    """``{device: 1.0 if some grad of optimizer's on this rank is inf/NaN else 0.0}``, read only."""
    flags: dict[torch.device, torch.Tensor] = {}
    for device, per_dtype in group_by_device_and_dtype(optimizer_grads(optimizer)).items():
        norms = [
            n for tensors in per_dtype.values() for n in torch._foreach_norm(tensors, math.inf)
        ]
        flags[device] = (~torch.stack(norms).isfinite()).any().float()
    return flags


# step function -> whether it takes grad_scaler=: inspect.signature costs ~30 us, more than the
# rest of a fused step's own work, so it is read once per plain function (weakly: a class can go).
# Functions hash by identity and their signature is fixed; any other callable (an object whose
# class's __call__ may be patched, or that hashes by value) is read afresh every time.
_TAKES_GRAD_SCALER: weakref.WeakKeyDictionary[types.FunctionType, bool] = (
    weakref.WeakKeyDictionary()
)


def takes_grad_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` takes torch's older ``grad_scaler`` keyword."""
    step = optimizer.step
    function: Any = getattr(step, "__func__", step)  # a bound method is new on every access
    cacheable = type(function) is types.FunctionType
    if cacheable and function in _TAKES_GRAD_SCALER:
        return _TAKES_GRAD_SCALER[function]
    try:
        takes = "grad_scaler" in inspect.signature(step).parameters
    except (TypeError, ValueError):  # a builtin or an odd callable: no keyword to pass
        takes = False
    if cacheable:
        _TAKES_GRAD_SCALER[function] = takes
    return takes
