"""torch.compile around ``scaler.step(optimizer)`` and ``scaler.update()``: what traces, what not.

The region after backward traces whole (``fullgraph=True``) where every decision stays on the
device: ``sync_free=True`` (the step undone on the device where the agreed flag is set), with a
foreach or plain optimizer, for ``GradScaler`` (either policy) and ``StepGuard`` (with or without
the spike gate). Inside it the traced forms of the seams run (``torch.compiler.is_compiling()``):
the optimizer's unwrapped step, copies and ``where`` instead of the flat snapshot, the update
folded into the counters at once, the all-reduce synchronous (``_c10d_functional``).

Every other configuration needs the host once per step (the skip decided from the agreed flag
read on the host, torch's fused optimizers, which torch itself runs eagerly under dynamo, step
callbacks that are told ``applied``), so its call runs eagerly, with the reason: without
``fullgraph`` that is a graph break, as today; with ``fullgraph=True`` torch raises the
reason, which names the configuration that compiles.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from dscale.scaler._stage import Stage

_COMPILES = (
    "torch.compile(fullgraph=True) around scaler.step()/update() needs every decision on the "
    "device: GradScaler(..., sync_free=True) (or StepGuard(..., sync_free=True)) with a "
    "foreach optimizer (foreach=True), after eager warm-up step(s) that create the optimizer "
    "state"
)

#: Why a step() runs eagerly under torch.compile (the graph break's reason), by configuration.
HOST_DECISION = (
    "this scaler decides the skip on the host (sync_free=False: one read of the agreed flag "
    "per step), which ends a compiled region. " + _COMPILES
)
FUSED = (
    "the optimizer is fused (fused=True), and torch runs fused optimizers eagerly under "
    "torch.compile (Inductor writes its own fused kernel for foreach=True). " + _COMPILES
)
CALLBACKS = (
    "a step callback (register_step_callback) is told whether the step was applied, a host "
    "read of the agreed flag per step; read step_applied() outside the compiled region "
    "instead. dscale's features that count steps register one too (dscale.precision's "
    "PrecisionSchedule, dscale.fp8's WeightScales, Float8Numerics and Float8Fallback): with "
    "them, compile without fullgraph=True (step() then runs eagerly). " + _COMPILES
)
HOOKED_STEP = (
    "the optimizer's step has hooks or was replaced (opt.step = ...), and the scaler runs the "
    "class's own step in the compiled region. " + _COMPILES
)
UNSCALED = (
    "unscale_() ran eagerly before this step(): call scaler.unscale_(optimizer) inside the "
    "compiled region too, or not at all. " + _COMPILES
)
OBSERVERS = (
    "observers are attached (add_observer: metrics, numerics stats), and their host code "
    "cannot run in a compiled region: call it inside `with scaler.observing(optimizer):`, "
    "which runs them eagerly around the region. " + _COMPILES
)
ATTACHED = (
    "attach() folded the check into the model's gradient reduction, and step() reads what "
    "its hooks recorded on the host (which grads they left, unwritten), which does not trace; "
    "compile the region without attach() (step() then checks the grads itself). " + _COMPILES
)
STEP_REASONS = (HOST_DECISION, FUSED, CALLBACKS, HOOKED_STEP, UNSCALED, OBSERVERS, ATTACHED)

#: Why an update() runs eagerly under torch.compile.
HOST_UPDATE = (
    "this iteration's decisions were taken on the host (a step() that ran eagerly, or "
    "sync_free=False), so update() runs eagerly too. " + _COMPILES
)
NEW_SCALE = "update(new_scale=...) sets the scale from the host; call it outside the region"
UPDATE_REASONS = (HOST_UPDATE, NEW_SCALE)


def step_refusal(scaler: Any, optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``scaler.step(optimizer)`` cannot trace (one of :data:`STEP_REASONS`), or None."""
    if not scaler._enabled:
        return None
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return FUSED
    if not scaler._sync_free:
        return HOST_DECISION
    if scaler._callbacks:
        return CALLBACKS
    if scaler._observers and not scaler._observing:
        return OBSERVERS
    if scaler._hooks.states:
        return ATTACHED
    own = vars(optimizer).get("step")
    if (
        (own is not None and not getattr(own, "_wrapped_by_lr_sched", False))
        or optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
    ):
        return HOOKED_STEP
    state = scaler._per_optimizer_states.get(id(optimizer))
    if state is not None and state.stage is not Stage.READY:
        return UNSCALED
    return None


def update_refusal(scaler: Any, new_scale: Any) -> str | None:
    """Why ``scaler.update()`` cannot trace (one of :data:`UPDATE_REASONS`), or None."""
    if not scaler._enabled:
        return None
    if new_scale is not None:
        return NEW_SCALE
    states = scaler._per_optimizer_states.values()
    if any(s.applied is not None or s.deferred or s.stage is not Stage.STEPPED for s in states):
        return HOST_UPDATE
    return None


# ----------------------------------------------------------------- the first compiled call
#: Scalers whose state a compilation puts in its compiled form first (sync_free ones, placed).
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def track(scaler: Any) -> None:
    """Put ``scaler``'s state in its compiled form whenever torch.compile starts compiling.

    Eager warm-up updates leave the state where eager keeps it (on the host on the CPU, a log
    of rows on the device); the first compiled update moves it to the form compiled updates
    keep (the device buffer, folded). A graph traced before that move would not match the
    calls after it: one recompile at the second compiled call. Moving it first, eagerly, when
    dynamo starts a compilation (torch's compile-start callback, ``torch._dynamo.callback``),
    makes the first graph the one every later call runs. The move keeps every value (eager
    steps after it take the device path, with the same results). Called by every scale() of a
    sync_free scaler: ``torch._dynamo.reset()`` drops the callback, so it is checked again.
    """
    _LIVE.add(scaler)
    handler = getattr(getattr(torch._dynamo, "callback", None), "callback_handler", None)
    if handler is not None and _to_compiled_forms not in handler.start_callbacks:
        handler.register_start_callback(_to_compiled_forms)


def _to_compiled_forms(*_: Any) -> None:
    for scaler in list(_LIVE):
        if scaler._enabled and scaler._sync_free and scaler._book.placed:
            scaler._to_compiled_form()
            mark_static(scaler)


def mark_static(scaler: Any) -> None:
    """Mark the tensors the compiled region reads from ``scaler`` as static addresses.

    Inductor's cudagraph trees (``mode="reduce-overhead"``) keep a graph only where every input
    it writes in place is static (parameters, the optimizer's state, which torch marks itself);
    the scale, the device words, predictive's and the spike gate's buffers are the scaler's,
    so it marks them, eagerly, when compiling starts (``guard=False``: no recompile guard on
    the address; the tensors are made once and kept, and the gate writes into its fixed matrix
    under compile instead of swapping two). Not the loss the gate reads: a new tensor each step.
    """
    tensors = [*scaler._book.static_tensors()]
    if scaler._predictive is not None:
        tensors += scaler._predictive.static_tensors()
    if scaler._spike is not None:
        tensors += scaler._spike.static_tensors()
    for t in tensors:
        torch._dynamo.mark_static_address(t, guard=False)
