"""Skip an optimizer step on the device instead of on the host (``sync_free=True``, fused steps).

The optimizer always runs; afterwards every parameter and optimizer-state tensor is put back to its
value from before the step wherever the agreed overflow flag is set. No ``.item()``, so foreach and
plain optimizers step without a host sync. The price is a copy of the parameters and the optimizer
state per step (memory: one extra copy of both; time: one read and two writes of each).

Exactly equal to skipping, with these host reads of the flag by construction:
- the step that creates optimizer state (normally the first one) reads the flag once: state that a
  skipped step created is removed, as if the step never ran, and no device-side value can stand
  for "absent" (SGD's momentum buffer starts as the grad, ASGD's eta as the lr, ...);
- a state tensor kept on the CPU while the flag is on a GPU (Adam's ``step`` without
  ``capturable=True``) needs the flag on the host each step; ``capturable=True`` or ``fused=True``
  avoid it;
- a sparse state tensor (SGD's momentum buffer for sparse grads) has no masked copy on the device:
  the flag is read on the host each step, and a skipped step puts the saved copy back.
State that is not a tensor (a Python int ``step``) cannot be put back on the device: such an
optimizer is refused at its first step with an error that names it.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch

from dscale.scaler._program.flat_snapshot import FlatSnapshot
from dscale.scaler._program.unscale import copy_to


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class _SkipMask:
    """``found_inf > 0`` per device, copied safely (a CPU copy of a GPU flag waits for it)."""

    def __init__(self, found_inf: torch.Tensor) -> None:
        self.found_inf = found_inf
        self.on: dict[torch.device, torch.Tensor] = {}

    def __call__(self, device: torch.device) -> torch.Tensor:
        if device not in self.on:
            self.on[device] = copy_to(self.found_inf, device) > 0
        return self.on[device]

    def on_host(self) -> bool:
        """The flag on the host (a host sync on GPU): for state no device op can mask."""
        return bool(self.found_inf.item() > 0)


@dataclasses.dataclass
class _Saved:
    """The flat snapshot of one optimizer, and the state entries it holds, (param, key) in order."""

    snapshot: FlatSnapshot
    keys: list[tuple[torch.Tensor, Any]]


# The flat snapshot of each optimizer stepped sync-free, made again when its tensors change.
_SNAPSHOTS: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Saved] = weakref.WeakKeyDictionary()


def _flat_tensors(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor]
) -> list[torch.Tensor] | None:
    """Every parameter, then the state values of those that have state, in order; None when a
    value is not a tensor. Parameters without state (frozen ones, or all of them for an
    optimizer that keeps none, as SGD without momentum) are in it too: a step may still change
    them. C-speed only: no Python loop over the parameters.
    """
    states = filter(None, map(optimizer.state.get, params))  # get: it is a defaultdict
    values = list(chain.from_iterable(map(dict.values, states)))
    if not set(map(type, values)) <= {torch.Tensor}:
        return None
    return [*params, *values]


def _state_keys(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor]
) -> list[tuple[torch.Tensor, Any]]:
    """(param, key) of each state value, in :func:`_flat_tensors`' order (made with a snapshot)."""
    return [(p, key) for p in params for key in optimizer.state.get(p, ())]


def _same_layout(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return [(t.shape, t.dtype, t.device) for t in a] == [(t.shape, t.dtype, t.device) for t in b]


def _changed_layout(optimizer: torch.optim.Optimizer) -> RuntimeError:
    return RuntimeError(
        f"sync_free=True: {type(optimizer).__name__}.step() changed the set or shapes of its "
        "state tensors in a step that was not its first, so a skipped step cannot be undone on "
        "the device; use GradScaler(sync_free=False) for it"
    )


def masked_step(
    optimizer: torch.optim.Optimizer,
    found_inf: torch.Tensor,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> Any:
    """Run ``optimizer.step(*args, **kwargs)``, undone on the device where ``found_inf > 0``.

    While every state value is a dense tensor the undo is a flat snapshot per (device, dtype) of
    the parameters and the state there is: a handful of ops whatever the number of parameters,
    with or without state. State a step creates (its first, or a parameter's first grad) is
    removed if the step was skipped, which reads the flag on the host once. Otherwise (state in
    Python numbers, sparse or strided tensors) each tensor is saved and restored on its own.
    """
    kwargs = kwargs or {}
    if torch.compiler.is_compiling():
        return _traced_masked_step(optimizer, found_inf, args, kwargs)

    def run_step() -> Any:
        return optimizer.step(*args, **kwargs)

    params = _params(optimizer)
    tensors = _flat_tensors(optimizer, params)
    if tensors is None or not FlatSnapshot.fits(tensors):
        return _masked_step_per_tensor(optimizer, found_inf, run_step, params)
    saved = _SNAPSHOTS.get(optimizer)
    if saved is None or not saved.snapshot.covers(tensors):
        saved = _SNAPSHOTS[optimizer] = _Saved(
            FlatSnapshot(tensors), _state_keys(optimizer, params)
        )
    snapshot = saved.snapshot
    had_state = ids_with_state(optimizer)
    with torch.no_grad():
        snapshot.save()
    result = run_step()
    after = _flat_tensors(optimizer, params)
    fresh = state_created_since(optimizer, had_state)
    new_keys: list[tuple[torch.Tensor, Any]] = []
    if fresh or after is None or len(after) != len(tensors):
        # The step created state: restore what was saved, and remove the new state if skipped.
        after, new_keys = _split_new_state(optimizer, params, saved.keys, fresh)
    rebound = not snapshot.covers(after)
    if rebound and not _same_layout(after, tensors):
        raise _changed_layout(optimizer)
    skip = _SkipMask(found_inf)
    with torch.no_grad():
        mask_on = {device: skip(device) for device in snapshot.devices}
        snapshot.restore_where(mask_on, into=after if rebound else None)
    if rebound or fresh or new_keys:
        _SNAPSHOTS.pop(optimizer, None)  # made again around the new tensors next step
    if fresh or new_keys:
        _remove_state_if_skipped(optimizer, found_inf, fresh, new_keys)
    return result


def traced_optimizer_step(
    optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``optimizer.step()`` in the form dynamo traces: torch's ``_use_grad`` wrapper breaks the
    graph on purpose (pytorch #104053), so the unwrapped step runs under no_grad (as the wrapper
    sets it). Step hooks are not run here: the scaler takes such an optimizer eagerly."""
    raw = inspect.unwrap(type(optimizer).step)
    optimizer._opt_called = True  # type: ignore[attr-defined] # what an LR scheduler's wrapper sets
    with torch.no_grad():
        return raw(optimizer, *args, **kwargs)


def _traced_masked_step(
    optimizer: torch.optim.Optimizer,
    found_inf: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """:func:`masked_step` under torch.compile: a copy of each tensor, the step, a ``where`` per
    tensor (Inductor fuses them; the loops run at trace time). The optimizer state the step uses
    must exist (eager warm-up steps make it): creating it is the one host read of the flag. A
    parameter without state (all of them for an optimizer that keeps none, as SGD without
    momentum) is fine while the step creates none for it; one that does is refused."""
    params = _params(optimizer)
    tensors = list(params)
    keys: list[tuple[int, Any]] = []
    for p in params:
        state = optimizer.state.get(p)  # get: it is a defaultdict
        for key, value in (state or {}).items():
            if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
                raise RuntimeError(_NO_STATE_UNDER_COMPILE.format(name=type(optimizer).__name__))
            tensors.append(value)
            keys.append((id(p), key))
    with torch.no_grad():
        saved = [t.clone() for t in tensors]
    result = traced_optimizer_step(optimizer, args, kwargs)
    if [(id(p), key) for p in params for key in optimizer.state.get(p) or {}] != keys:
        raise RuntimeError(_NO_STATE_UNDER_COMPILE.format(name=type(optimizer).__name__))
    with torch.no_grad():
        skip = found_inf > 0
        for t, old in zip(tensors, saved, strict=True):
            t.copy_(torch.where(skip, old, t))
    return result


_NO_STATE_UNDER_COMPILE = (
    "torch.compile around scaler.step(): {name} has no optimizer state for every parameter yet "
    "(or keeps state that is not a dense tensor), and creating it on a step that may be skipped "
    "needs the flag on the host. Run the first step(s) eagerly (outside the compiled function) "
    "so that the state exists, as torchtitan and Megatron do before capturing the step"
)


def _split_new_state(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    keys: list[tuple[torch.Tensor, Any]],
    fresh: list[torch.Tensor],
) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, Any]]]:
    """After a step that created state: the saved tensors as they are now, and the new keys of
    parameters that had state before (a Python loop: only on a step that creates state)."""
    old: list[torch.Tensor] = []
    for p, key in keys:
        value = optimizer.state.get(p, {}).get(key)
        if not isinstance(value, torch.Tensor):
            raise _changed_layout(optimizer)
        old.append(value)
    saved = {(id(p), key) for p, key in keys}
    new_ids = set(map(id, fresh))
    new_keys = [
        (p, key)
        for p in params
        if id(p) not in new_ids
        for key in optimizer.state.get(p, ())
        if (id(p), key) not in saved
    ]
    return [*params, *old], new_keys


def _remove_state_if_skipped(
    optimizer: torch.optim.Optimizer,
    found_inf: torch.Tensor,
    fresh: list[torch.Tensor],
    new_keys: list[tuple[torch.Tensor, Any]],
) -> None:
    """The one host read: state created by a skipped step must go, not be zeroed."""
    if bool(found_inf.item() > 0):
        for p in fresh:
            optimizer.state.pop(p, None)
        for p, key in new_keys:
            optimizer.state[p].pop(key, None)
        return
    for p in fresh:
        for key, value in optimizer.state.get(p, {}).items():
            if value is not None and not isinstance(value, torch.Tensor):
                _refuse(optimizer, key, value, lambda: None)


def _masked_step_per_tensor(
    optimizer: torch.optim.Optimizer,
    found_inf: torch.Tensor,
    run_step: Callable[[], Any],
    params: list[torch.Tensor],
) -> Any:
    """:func:`masked_step` one tensor at a time: three ops per tensor, any state."""
    had_state = ids_with_state(optimizer)
    with torch.no_grad():
        old_params = [p.clone() for p in params]
        old_state: dict[torch.Tensor, dict[Any, tuple[Any, Any]]] = {
            p: {
                k: (v, v.clone() if isinstance(v, torch.Tensor) else v)
                for k, v in optimizer.state[p].items()
            }
            for p in params
            if p in optimizer.state
        }
    result = run_step()
    fresh = state_created_since(optimizer, had_state)
    skip = _SkipMask(found_inf)
    new_keys: list[tuple[torch.Tensor, Any]] = []
    with torch.no_grad():
        for p, old in zip(params, old_params, strict=True):
            p.copy_(torch.where(skip(p.device), old, p))
        for p, before in old_state.items():
            state = optimizer.state[p]
            for key, value in list(state.items()):
                if key not in before:
                    new_keys.append((p, key))
                    continue
                original, saved = before[key]
                if isinstance(value, torch.Tensor) and isinstance(saved, torch.Tensor):
                    if value.layout != torch.strided or saved.layout != torch.strided:
                        # A sparse buffer (SGD's momentum for sparse grads): no where() for
                        # it, so the flag is read on the host; the saved copy goes back whole.
                        if skip.on_host():
                            state[key] = saved
                        continue
                    restored = torch.where(skip(value.device), saved, value)
                    if value is original:
                        value.copy_(restored)
                    else:  # the optimizer rebound state[key]: rebind it to the masked value
                        state[key] = restored
                elif value is not original and value != saved:
                    _refuse(optimizer, key, value, lambda: _undo_on_host(optimizer, old_state))
    if fresh or new_keys:
        _remove_state_if_skipped(optimizer, found_inf, fresh, new_keys)
    return result


def _undo_on_host(
    optimizer: torch.optim.Optimizer, old_state: dict[torch.Tensor, dict[Any, tuple[Any, Any]]]
) -> None:
    for p, before in old_state.items():
        for key, (_, saved) in before.items():
            if not isinstance(saved, torch.Tensor):
                optimizer.state[p][key] = saved


def _refuse(
    optimizer: torch.optim.Optimizer, key: Any, value: Any, undo: Callable[[], None]
) -> None:
    undo()
    raise ValueError(
        f"sync_free=True cannot undo a skipped step of {type(optimizer).__name__}: its state "
        f"{key!r} is a Python {type(value).__name__}, not a tensor, so it cannot be put back on "
        "the device. Use GradScaler(sync_free=False) for this optimizer (it skips on the host), "
        "or keep that state in a tensor"
    )


def ids_with_state(optimizer: torch.optim.Optimizer) -> set[int] | None:
    """ids of the parameters that have optimizer state, or None when all have (none can come).

    Taken before a step, for :func:`state_created_since` after it.
    """
    if len(optimizer.state) >= sum(len(g["params"]) for g in optimizer.param_groups):
        return None  # the common case after the first step: no Python loop over the parameters
    return set(map(id, optimizer.state))


def state_created_since(
    optimizer: torch.optim.Optimizer, before: set[int] | None
) -> list[torch.Tensor]:
    """Parameters that got optimizer state since ``before`` was taken.

    Empty, at the cost of two len() calls, when the step created none: an optimizer that keeps
    no state (SGD without momentum) never gets here, so it never needs the flag on the host.
    """
    if before is None or len(optimizer.state) <= len(before):
        return []
    return [p for p in optimizer.state if id(p) not in before]


def remove_state_created_by_skipped_step(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], found_inf: torch.Tensor
) -> None:
    """After a fused step that created state for ``params``: remove it if the step was skipped.

    torch's fused kernels skip the update where ``found_inf`` is set but still create the state
    (fused SGD even leaves its momentum buffer uninitialised). Removing it makes the skipped step
    equal to not stepping. This reads the flag on the host, on the state-creating step only.
    """
    if bool(found_inf.item() > 0):
        for param in params:
            optimizer.state.pop(param, None)


def fused_step(
    optimizer: torch.optim.Optimizer,
    found_inf: torch.Tensor,
    grad_scale: torch.Tensor | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """A fused optimizer's step, told the flag as torch tells it: its kernel skips where 1.

    ``grad_scale`` and ``found_inf`` are set on the optimizer for the step only (torch's
    contract); state that a skipped step created is removed, as if it never ran.
    """
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    before = ids_with_state(optimizer)
    try:
        retval = optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]
    fresh = state_created_since(optimizer, before)
    if fresh:
        remove_state_created_by_skipped_step(optimizer, fresh, found_inf)
    return retval
