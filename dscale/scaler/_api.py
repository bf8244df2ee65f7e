"""dscale.GradScaler: torch's GradScaler API, with every rank taking the same decision."""

from __future__ import annotations

import contextlib
import warnings
from collections import abc
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from dscale import _dist
from dscale.scaler import _check, _compiled, _decision, _legacy_step, _pipeline, _watchdogs
from dscale.scaler._attach.hooks import AttachRefusal, ReductionHooks
from dscale.scaler._program import agreement as _agreement
from dscale.scaler._program import predictive as _predictive
from dscale.scaler._program import scale_rule as _policy
from dscale.scaler._program import spike_gate as _spike_gate
from dscale.scaler._program import unscale as _unscale
from dscale.scaler._program.masked_step import fused_step, masked_step
from dscale.scaler._program.unscale import copy_to
from dscale.scaler._stage import OptimizerState, Stage
from dscale.scaler._state import format as _state
from dscale.scaler._state import predictive as _predictive_state
from dscale.scaler._state import readings as _scaler_state
from dscale.scaler._state.book import ScaleState, fresh_host_state
from dscale.scaler._torch_compat import TorchGradScalerSurface
from dscale.scaler._warnings import warn_if_scaling_is_not_needed
from dscale.scaler._watchdogs import ScaleCollapsedError, StuckPolicy

__all__ = ["GradObserver", "GradScaler", "ScaleCollapsedError"]


class GradObserver(Protocol):
    """Something that watches the gradients and outcomes (e.g. ``dscale.stats``)."""

    def on_grads(
        self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], scale: torch.Tensor
    ) -> None:
        """Called with the rank-local, still scaled grads right before the check; no host sync."""

    def on_update(self, scaler: GradScaler, found_inf: torch.Tensor) -> None:
        """Called at the end of every update() with the agreed flag (> 0: the step was skipped)."""


# Under torch.compile the scaler's calls run eagerly (a graph break each, as torch's own scaler
# gets): they read process groups, device state and host decisions that dynamo cannot trace.
_eager = torch.compiler.disable


def _predictive_setup(
    policy: _predictive_state.Policy,
    window: int | None,
    init_scale: float,
    growth_interval: int,
    min_scale: float | None,
    max_scale: float | None,
) -> tuple[_predictive_state.PredictiveScaling | None, float, int]:
    """policy="predictive"'s state, the scale its first step runs at, and its device words
    (None, ``init_scale`` and 0 for the dynamic policy)."""
    if policy != "predictive":
        return None, init_scale, 0
    window = window or _predictive_state.DEFAULT_WINDOW
    # Overflows are remembered as long as the dynamic rule stays backed off.
    return (
        _predictive_state.PredictiveScaling(window, growth_interval),
        _predictive.first_scale(init_scale, min_scale, max_scale),
        _predictive_state.tail_words(window, growth_interval),
    )


# issue 13: a subclass of torch.amp.GradScaler; torch's internals are answered in _torch_compat.
class GradScaler(TorchGradScalerSurface):
    """Dynamic loss scaler for fp16 training that keeps every rank in agreement.

    A drop-in for ``torch.amp.GradScaler``: same arguments, methods and state dict. Each rank checks
    its own gradients (the local shard under FSDP) for inf/NaN in one fused pass per device and
    dtype; the one-element overflow flag is then all-reduced (MAX) once per optimizer step, so all
    ranks skip, grow or back off together even when only one rank's shard overflowed.

    This class keeps torch's API and the per-optimizer stage machine; the step's work is done by
    the stage modules it calls: ``_check`` (grads to this rank's agreement vector), ``_decision``
    (the agreed vector read), ``masked_step`` (the optimizer's step, skipped on the device), then
    the book's rule in update() (``docs/CONTRACTS.md``, "The step path, in stages").

    Example::

        scaler = dscale.GradScaler("cuda")
        for x, y in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

    Args:
        device: where the scale lives ("cuda" or "cpu"), as in torch.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as in torch.
        process_group: the ranks that must agree; default: the world group when
            ``torch.distributed`` is initialized with more than one rank.
        min_scale: never back off below this (torch's scale can underflow to 0).
        max_scale: never grow above this.
        hysteresis: overflows tolerated before backing off (1 = back off every time, as torch).
            Overflowing steps are skipped regardless.
        hysteresis_refill: "on_growth" (Megatron, DeepSpeed default) or "on_clean_step"
            (DeepSpeed's consecutive_hysteresis).
        on_stuck_at_min: with ``min_scale`` set, what to do when ``stuck_patience`` steps in a
            row were skipped at the minimum: "raise" ScaleCollapsedError or "warn" (logged).
        stuck_patience: skipped steps in a row at ``min_scale`` before ``on_stuck_at_min`` acts.
        sync_free: skip on the device (the update is undone where the flag is set) instead of
            deciding on the host; no host sync for any optimizer, at the cost of a copy of the
            parameters and optimizer state per step. On the CPU, where reading the flag costs
            nothing, steps are skipped on the host instead.
        policy: "dynamic" (torch's rule: search for the scale by overflowing) or "predictive"
            (set it from the measured gradient range; see ``dscale.scaler._program.predictive``).
            A predictive
            scaler's first step runs at ``min(init_scale, 1.0)`` to measure, then jumps.
        predictive_window: policy="predictive": the number of recent steps whose largest
            gradient sets the scale (default 8); an overflow is remembered for
            ``growth_interval`` steps, as long as the dynamic rule stays backed off.
        spike_signals: the spike gate, off when empty: skip (on every rank) a step whose
            "loss" and/or "grad_norm" is more than ``spike_sigma`` standard deviations above
            the mean of the last ``spike_window`` applied steps, once ``spike_warmup`` values
            are in (OLMo-core's and Levanter's rule; see ``docs/step-guard.md``). The loss is
            what scale() was given this iteration, averaged over the ranks; both travel in the
            step's agreement all-reduce. Counted apart from overflows (``spike_skipped_steps``).
        spike_sigma, spike_window, spike_warmup: the gate's threshold, window and warm-up.
    """

    def __init__(
        self,
        device: str | torch.device = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        process_group: Any | None = None,
        min_scale: float | None = None,
        max_scale: float | None = None,
        hysteresis: int = 1,
        hysteresis_refill: _policy.HysteresisRefill = "on_growth",
        on_stuck_at_min: StuckPolicy = "warn",
        stuck_patience: int = 100,
        sync_free: bool = False,
        policy: _predictive_state.Policy = "dynamic",
        predictive_window: int | None = None,
        spike_signals: Sequence[str] = (),
        spike_sigma: float = 6.0,
        spike_window: int = 128,
        spike_warmup: int = 64,
    ) -> None:
        _predictive_state.check_policy(policy)
        if predictive_window is not None:
            _predictive_state.check_window(predictive_window)
        signals = _spike_gate.check_spike_args(
            spike_signals, spike_sigma, spike_window, spike_warmup
        )
        _state.check_scale_args(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=hysteresis,
            hysteresis_refill=hysteresis_refill,
            within_bounds=True,
        )
        _watchdogs.check_stuck_args(on_stuck_at_min, stuck_patience)
        self._device = str(torch.device(device).type) if not isinstance(device, str) else device
        self._enabled = bool(enabled)
        if self._enabled and self._device == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "dscale.GradScaler is enabled with device='cuda', but CUDA is not available; "
                "disabling it. Pass device='cpu' to scale on the CPU.",
                stacklevel=2,
            )
            self._enabled = False
        self._policy = _policy.ScalePolicy(
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=growth_interval,
            min_scale=None if min_scale is None else float(min_scale),
            max_scale=None if max_scale is None else float(max_scale),
            hysteresis=hysteresis,
            hysteresis_refill=hysteresis_refill,
        )
        self._on_stuck_at_min: StuckPolicy = on_stuck_at_min
        self._stuck_patience = stuck_patience
        self._sync_free = bool(sync_free)
        self._group_arg = process_group
        self._group_ranks = _dist.group_ranks(process_group)
        # The scale and trackers; on the host until the first scale() puts them on a device.
        # policy="predictive" (scaler/_program/predictive.py): its measurement and state.
        self._predictive, init_scale, tail = _predictive_setup(
            policy, predictive_window, init_scale, growth_interval, min_scale, max_scale
        )
        self._book = ScaleState(fresh_host_state(float(init_scale), hysteresis), tail)
        self._placed_init_scale = float(init_scale)  # torch's _init_scale, once placed
        self._init_running_state()
        self._spike = (
            _spike_gate.SpikeGate(
                signals, sigma=spike_sigma, window=spike_window, warmup=spike_warmup
            )
            if signals
            else None
        )

    def _init_running_state(self) -> None:
        """What the running job keeps between calls: per-optimizer states, hooks, callbacks."""
        self._per_optimizer_states: dict[int, OptimizerState] = {}
        self._outcomes: dict[int, bool | torch.Tensor] = {}
        self._last_stepped: int | None = None
        self._callbacks: list[Callable[[torch.optim.Optimizer, bool], None]] = []
        self._fields: list[_agreement.AgreementField] = []  # features' fields (dscale.fp8)
        self._observers: list[GradObserver] = []
        # Inside observing(): the observers were handed the grads; update()'s flag waits for
        # the block's end (a compiled update() cannot call them). See observing().
        self._observing = False
        self._observed: torch.Tensor | None = None
        self._updates_since_stuck_check = 0
        self._hooks = ReductionHooks()
        # The last update()'s scale range, or the agreed vector it is read from on request.
        self._scale_range: _agreement.ScaleRange | torch.Tensor | str | None = None
        self._scale_calls = 0
        self._iteration = 0  # update() calls: every rank counts alike (the vector's schedule)
        # Decide fused and sync_free steps on the host when the agreed flag is in host memory.
        # Tests turn it off to run the device-side decision (the CUDA path) on the CPU.
        self._read_host_flags = True
        # What _get_scale_async() answers a step(grad_scaler=...) optimizer whose grads are
        # unscaled already (attach()'s hooks): 1, since it divides by what it reads.
        self._scale_for_step: torch.Tensor | None = None
        # id of the optimizer whose step(grad_scaler=...) runs: its reads of the flag agree.
        self._stepping: int | None = None
        self._factors = _unscale.UnscaleFactors()  # 1/scale and 1.0 as tensors, made once
        # False for a StepGuard (dscale/step_guard.py): the scale is 1 and never moves.
        self._loss_scaling = True
        self._spike_warned_at = 0  # the spike run length last warned about
        # pipeline_loss(): how the microbatch losses combine (None: not pipelined); the flag
        # says scale() is called by it, with the loss recorded already.
        self._pipeline: _pipeline.MicrobatchReduction | None = None
        self._loss_recorded = False
        self._watch_due = False  # a compiled update() left the watchdogs to the next scale()

    # ----------------------------------------------------------------- device state
    def _scale_on(self, device: torch.device) -> torch.Tensor:
        if self._book.scale is None:
            self._book.place(device)
        assert self._book.scale is not None  # noqa: S101 - placed just above
        return self._book.scale

    def _require_scale(self, funcname: str) -> torch.Tensor:
        if self._book.scale is None:
            raise _no_scale_error(funcname)
        return self._book.scale

    def _refuse_without_a_scale(self, optimizer: torch.optim.Optimizer, funcname: str) -> None:
        """step() or unscale_() with no scale placed: raise, after joining the peers.

        A rank that called no scale() (a pipeline stage whose schedule was built without
        pipeline_loss() while the others' were) would otherwise leave its peers waiting in the
        agreement until the process group's timeout: it joins them as a refusal (they skip),
        then raises. unscale_() joins at the flag's first read, as attach()'s refusals do.
        """
        if self._book.scale is not None:
            return
        exc = _no_scale_error(funcname)
        state = self._per_optimizer_states.get(id(optimizer))
        if state is not None and state.refused is not None and state.deferred:
            _decision.start_deferred(self, state)  # unscale_() refused already: join, raise
        state = OptimizerState()
        if _check.join_peers_without_a_scale(self, optimizer, state, exc, funcname == "unscale_"):
            self._per_optimizer_states[id(optimizer)] = state  # step() joins, then raises
            state.stage = Stage.UNSCALED
            return
        raise exc

    def _place_without_a_loss(self, optimizer: torch.optim.Optimizer) -> None:
        """A pipelined stage that holds no loss calls no scale(): its first step() or
        unscale_() places the scale where the optimizer's parameters are (once)."""
        if self._book.scale is not None or self._pipeline is None:
            return
        for group in optimizer.param_groups:
            for param in group["params"]:
                self._scale_on(param.device)
                return

    def pipeline_loss(
        self,
        loss_fn: Callable[..., torch.Tensor],
        *,
        microbatch_reduction: _pipeline.MicrobatchReduction = "mean",
    ) -> Callable[..., torch.Tensor]:
        """``loss_fn`` for a ``torch.distributed.pipelining`` schedule: scaled, and recorded.

        Build every stage's schedule with it (``ScheduleGPipe(stage, n, loss_fn=
        scaler.pipeline_loss(loss_fn))``). The schedule's backward then runs from the scaled
        loss; a stage without the loss needs no ``scale()`` call of its own (its first step()
        places the scale); the spike gate's loss is the step's: the mean (or the sum, for
        ``microbatch_reduction="sum"``, a ``loss_fn`` that returns each microbatch's share
        under ``scale_grads=False``) of this step's microbatch losses, averaged over the ranks
        that hold one. torch's shape-inference call of ``loss_fn`` (a schedule's first step, on
        uninitialised tensors) and ``schedule.eval()``'s calls are returned unscaled and not
        recorded. See ``docs/scaler.md``, "Pipeline parallel".
        """
        reduction = _pipeline.check_reduction(microbatch_reduction)
        if self._pipeline is not None and reduction != self._pipeline:
            # One setting per scaler: the wrappers made earlier would follow the new one.
            raise ValueError(
                f"pipeline_loss(microbatch_reduction={reduction!r}) on a scaler whose "
                f"pipeline_loss() was made with {self._pipeline!r}: the step's loss is "
                "combined one way, for every schedule of this scaler (a rebuilt schedule "
                "included); pass the same microbatch_reduction, or use another scaler"
            )
        wrapped = _pipeline.PipelineLoss(self, loss_fn)
        self._pipeline = reduction
        if self._spike is not None:
            self._spike.pipelined = True
            self._spike.microbatch_reduction = reduction
        return wrapped

    def _records_loss(self) -> bool:
        """Whether scale() adds what it is given to the spike gate's loss."""
        assert self._spike is not None  # noqa: S101 - asked with the gate on
        # A pipelined scaler records the schedule's microbatch losses only: a scale() of its
        # own (the old dummy scale(torch.zeros(())) of a loss-less stage) would make that
        # stage count as one holding the loss, and halve the step's mean.
        if not self._spike.watches_loss or self._loss_recorded or self._pipeline is not None:
            return False
        return _pipeline.call_site() == _pipeline.TRAINING

    def _scale_microbatch_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """PipelineLoss: one microbatch's loss, recorded as such, times the scale."""
        if not self._enabled:
            return loss
        if self._spike is not None:
            self._spike.add_microbatch_loss(loss)
        self._loss_recorded = True
        try:
            return self.scale(loss)  # type: ignore[no-any-return]
        finally:
            self._loss_recorded = False

    def _process_group(self) -> Any | None:
        if self._group_arg is None and self._group_ranks is not None:
            self._group_arg = _dist.find_group(self._group_ranks)
        return _dist.resolve_group(self._group_arg)

    # ----------------------------------------------------------------- torch's API
    @_eager
    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or nested lists/tuples of tensors, by the scale."""
        if not self._enabled:
            return outputs
        self._after_compiled_update()
        if self._sync_free:  # the state moves to its compiled form when compiling starts
            _compiled.track(self)
        self._scale_calls += 1  # attach()'s hooks refuse a backward with no scale() before it
        # Not a pipeline stage's shape inference nor an eval() (see _pipeline.call_site).
        if self._spike is not None and self._records_loss():
            self._spike.add_loss(outputs)
        if not self._loss_scaling:  # a StepGuard: nothing to multiply; place the state only
            tensors = _spike_gate.tensors_in(outputs)
            if not tensors:
                raise ValueError(
                    "scale() takes a Tensor or an iterable of Tensors, got "
                    f"{type(outputs).__name__}"
                )
            self._scale_on(tensors[0].device)
            return outputs
        if isinstance(outputs, torch.Tensor):
            scale = self._scale_on(outputs.device)
            warn_if_scaling_is_not_needed(outputs)
            return outputs * copy_to(scale, outputs.device)

        per_device: dict[torch.device, torch.Tensor] = {}

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if value.device not in per_device:
                    scale = self._scale_on(value.device)
                    per_device[value.device] = copy_to(scale, value.device)
                return value * per_device[value.device]
            if isinstance(value, abc.Iterable):
                mapped = map(apply, value)
                return type(value)(mapped) if isinstance(value, (list, tuple)) else mapped
            raise ValueError(
                f"scale() takes a Tensor or an iterable of Tensors, got {type(value).__name__}"
            )

        return apply(outputs)

    @_eager
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s grads by the scale in place and check them for inf/NaN.

        Optional: step() does it when you don't. Call it before clipping. No host sync. The
        ranks agree on the flag in step() (or update()), so a ``found_inf_per_device`` that code
        written for torch's scaler writes in between counts, as in torch; a read in between
        (``_found_inf_per_device()``) gives this rank's flag, as torch's, and no collective.
        """
        if not self._enabled:
            return
        self._place_without_a_loss(optimizer)
        self._refuse_without_a_scale(optimizer, "unscale_")
        if self._book.scale is None:  # joined the peers as a refusal: step() raises
            return
        state = self._per_optimizer_states.setdefault(id(optimizer), OptimizerState())
        if state.stage is Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(). "
                "Call unscale_(optimizer) at most once per iteration, between backward() and "
                "step(optimizer), then update() once after step()"
            )
        if state.stage is Stage.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(). Call unscale_(optimizer) before "
                "step(optimizer) (to clip the gradients), or not at all: step() unscales"
            )
        if not state.prechecked:
            _check.check(self, optimizer, state, unscale=True, defer=True)
        state.stage = Stage.UNSCALED

    def _decides_on_host(self, agreed: torch.Tensor) -> bool:
        """Whether fused and sync-free steps read the agreed flag on the host (``agreed``'s device).

        On the CPU the flag is already in host memory: reading it costs nothing, and deciding on
        the host makes update() plain arithmetic instead of tensor ops. Tests and the op-count
        benchmark turn ``_read_host_flags`` off to run the device-side path, as on CUDA.
        """
        if torch.compiler.is_compiling():  # a host read would end the compiled region
            return False
        return agreed.device.type == "cpu" and self._read_host_flags

    def _carries_range(self) -> bool:
        """Whether this iteration's vector carries the scale fields (see ``agreement``).

        Always with the spike gate: its slots follow the scale fields, at a fixed place.
        """
        if torch.compiler.is_compiling():  # every compiled iteration: no per-step number
            return True
        return _agreement.carries_range(self._iteration) or self._spike is not None

    # ----------------------------------------------------------------- reduction hooks
    def attach(self, model: torch.nn.Module) -> None:
        """Fold the unscale and the inf/NaN check into the model's gradient reduction.

        DDP: replaces the comm hook; each bucket is averaged, unscaled and checked in one pass
        while it is hot, so step() does no unscale pass. FSDP2 (``fully_shard``): each
        reduce-scatter output is unscaled and checked in an all-reduce hook. Either way the flag
        covers the whole model: an overflow anywhere in it skips every optimizer over its
        parameters. The grads are unscaled at backward's end, as after ``unscale_()``. step()
        checks them again for inf/NaN (times 1, no unscale) and runs the one-element agreement
        all-reduce, DDP included: a write since the reduction through an alias whose version
        does not move (``p.grad.data``, ``.numpy()``) is invisible to the hooks and may be on
        one rank only. Call once, before the first backward.
        """
        if self._enabled:
            measure = None if self._predictive is None else self._predictive.measure
            self._hooks.attach(
                model,
                lambda: self._require_scale("backward"),
                lambda: self._scale_calls,
                measure,
            )

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done), agree across ranks, then step unless some rank overflowed.

        Returns the optimizer's return value, or None when the step was skipped. With a plain or
        foreach optimizer the skip decision reads the agreed flag (one host sync, as torch); fused
        optimizers (``_step_supports_amp_scaling``) and ``sync_free=True`` decide on the device,
        except on the CPU, where the flag is in host memory already and is read there for free.
        Under ``torch.compile`` a ``sync_free`` step traces; any other runs eagerly, and
        ``fullgraph=True`` raises why (``dscale.scaler._compiled``).
        """
        if torch.compiler.is_compiling():
            reason = _compiled.step_refusal(self, optimizer)
            if reason is not None:
                return _EAGER_STEP[reason](self, optimizer, *args, **kwargs)
        return self._step(optimizer, *args, **kwargs)

    def _step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError(
                "Closure use is not currently supported if GradScaler is enabled: call "
                "scaler.scale(loss).backward() yourself, then scaler.step(optimizer)."
            )
        self._place_without_a_loss(optimizer)
        self._refuse_without_a_scale(optimizer, "step")
        state = self._per_optimizer_states.setdefault(id(optimizer), OptimizerState())
        if state.stage is Stage.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(). Call step(optimizer) "
                "once per optimizer per iteration, then update() once after step()"
            )
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        if fused and _legacy_step.takes_grad_scaler(optimizer):
            if self._spike is not None:
                raise ValueError(
                    f"{type(optimizer).__name__}.step(grad_scaler=...) checks its grads itself and "
                    "skips on the overflow flag only, so the spike gate cannot skip its steps; "
                    "turn the gate off (spike_signals=()) for this optimizer"
                )
            retval = _legacy_step.step_passing_scaler(self, optimizer, state, args, kwargs)
            return self._stepped(optimizer, state, retval)
        unscaled = self._checked(optimizer, state, fused)
        decided = _decision.for_step(self, state, fused=fused)
        if fused:  # the flag goes into the kernel, which skips where it is 1
            assert decided.flag is not None  # noqa: S101 - a fused step always gets it
            grad_scale = self._grad_scale_for(optimizer, unscaled)
            retval = fused_step(optimizer, decided.flag, grad_scale, args, kwargs)
        elif decided.flag is not None:  # sync_free: the step runs, undone where the flag is set
            retval = masked_step(optimizer, decided.flag, args, kwargs)
        else:  # decided on the host (the one sync a plain step needs)
            retval = optimizer.step(*args, **kwargs) if decided.outcome else None
        self._outcomes[id(optimizer)] = decided.outcome
        return self._stepped(optimizer, state, retval)

    def _checked(
        self, optimizer: torch.optim.Optimizer, state: OptimizerState, fused: bool
    ) -> bool:
        """Run the check unless unscale_() did; whether the grads are unscaled afterwards."""
        if state.stage is Stage.READY:
            # Unscaling in the check pass instead of the fused kernel is proven bit-identical
            # (the differential matrices) for torch.optim's own fused kernels only; any other
            # optimizer that does its own scaling gets the grads still scaled, as from torch.
            unscale = (None if _is_torch_fused(optimizer) else False) if fused else True
            return _check.check(self, optimizer, state, unscale=unscale)
        if state.agreed is None:  # marked UNSCALED by code that unscaled the grads itself
            _check.check(self, optimizer, state, unscale=False, unscaled_by_caller=True)
        else:
            _decision.refuse_a_backward_since_unscale(self, optimizer, state)
        return True

    def _grad_scale_for(self, optimizer: torch.optim.Optimizer, unscaled: bool) -> Any:
        """torch's contract for a fused step's ``grad_scale``: the product with one the user
        set, None (or the user's) once unscaled."""
        own = getattr(optimizer, "grad_scale", None)
        if unscaled or not self._loss_scaling:
            return own
        scale = self._require_scale("step")
        return scale if own is None else scale * own

    def _stepped(self, optimizer: torch.optim.Optimizer, state: OptimizerState, retval: Any) -> Any:
        state.stage = Stage.STEPPED
        self._last_stepped = id(optimizer)
        for callback in self._callbacks:
            callback(optimizer, self.step_applied(optimizer))
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Grow, keep or back off the scale once for this iteration, on every rank alike.

        Call once per iteration after step() for all optimizers. ``new_scale`` (a float or a
        one-element tensor) sets the scale directly instead. No host sync: after plain steps the
        decision is already known on the host and the update is host arithmetic.
        """
        if torch.compiler.is_compiling():
            reason = _compiled.update_refusal(self, new_scale)
            if reason is not None:
                return _EAGER_UPDATE[reason](self, new_scale)  # type: ignore[no-any-return]
        return self._update(new_scale)

    def _update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not self._enabled:
            return
        self._require_scale("update")
        states = list(self._per_optimizer_states.values())
        if new_scale is not None:
            self._set_scale(new_scale, states)
            return
        self._refuse_an_unchecked_iteration(states)
        refused = None
        for state in states:
            if state.deferred:  # unscale_() without step(): agree on it now
                try:
                    _decision.start_deferred(self, state)
                except AttachRefusal as exc:
                    # This rank joined its peers' agreement (a skip): update as they do, then
                    # raise, so that the next iteration starts on every rank alike.
                    refused = exc
        self._scale_range = _decision.scale_range_source(self, states)
        known = all(s.applied is not None for s in states)
        # Overflows only: a step the spike gate skipped is no reason to back off the scale.
        skipped = any(s.overflowed for s in states) if known else None
        # The flag as a tensor only where it is used: a device-side update, or observers.
        on_device = not known or self._book.host is None
        found = _decision.iteration_flag(self, states) if on_device or self._observers else None
        skip_flag = _decision.end_spike_iteration(self, states)
        if self._predictive is not None:  # policy="predictive": this iteration's measurement
            self._predictive_measured(states)
        self._book.update(
            self._policy, found, skipped, self._predictive, pinned=not self._loss_scaling
        )
        self._end_iteration()
        if torch.compiler.is_compiling():  # they read the host: at the next eager call
            self._watch_due = True
        else:
            self._watch()
        if skip_flag is not None and found is not None:
            found = skip_flag  # observers hear "the step was skipped", for a spike too
        if self._observers and (self._observing or torch.compiler.is_compiling()):
            self._observed = found  # delivered eagerly: observing()'s end or the next scale()
        else:
            self._notify_update(found)
        if refused is not None:
            raise refused

    def _watch(self) -> None:
        """The watchdogs after an update: a scale stuck at min_scale, a run of spike skips."""
        min_scale = self._policy.min_scale
        due, self._updates_since_stuck_check = _watchdogs.collapse_check_due(
            self._book, min_scale, self._stuck_patience, self._updates_since_stuck_check
        )
        if due:
            assert min_scale is not None  # noqa: S101 - due only with a min_scale
            _watchdogs.watch_for_collapse(
                self._book,
                min_scale,
                on_stuck_at_min=self._on_stuck_at_min,
                patience=self._stuck_patience,
                loss_scaling=self._loss_scaling,
            )
        self._spike_warned_at = _watchdogs.watch_spikes(
            self._spike, patience=self._stuck_patience, warned_at=self._spike_warned_at
        )

    def _notify_update(self, found: torch.Tensor | None) -> None:
        for observer in self._observers:
            observer.on_update(self, found)  # type: ignore[arg-type]

    def _deliver_observed(self) -> None:
        """Hand the observers the flag of an update() that could not call them."""
        found, self._observed = self._observed, None
        if found is not None:
            self._notify_update(found)

    def _after_compiled_update(self) -> None:
        """What a compiled update() leaves to the next eager call (scale()): the host copies
        for scrapes, the watchdogs (a collapse raises there, before the next backward), and the
        observers' on_update outside observing()."""
        self._deliver_observed()
        tag = None
        if self._predictive is not None:
            self._predictive.settle()  # a compiled update's turn of the rings
            tag = self._predictive.pos["window"]
        self._book.publish_if_due(tag)
        if self._spike is not None:
            self._spike.publish_if_due()
        if self._watch_due:
            self._watch_due = False
            self._watch()

    def _to_compiled_form(self) -> None:
        """The state where compiled updates keep it, values unchanged (``_compiled.track``)."""
        self._book.to_device_form()
        tail = self._book.tail
        if self._predictive is not None and tail is not None:
            self._predictive.to_device_form(tail)

    def _set_scale(self, new_scale: float | torch.Tensor, states: list[OptimizerState]) -> None:
        """update(new_scale=...): the scale is set, whatever the iteration's steps did."""
        if not self._loss_scaling:
            raise RuntimeError(
                "update(new_scale=...) on a StepGuard: it does not scale the loss, so it has "
                "no scale to set; call update() with no argument"
            )
        _decision.end_spike_iteration(self, states)
        self._book.set_scale(_state.checked_new_scale(new_scale))
        if self._predictive is not None:
            self._predictive.skip_iteration()
        self._end_iteration()

    def _refuse_an_unchecked_iteration(self, states: list[OptimizerState]) -> None:
        if not states:
            raise RuntimeError(
                "update() found no inf checks since the last update(): call "
                "scaler.step(optimizer) (or scaler.unscale_(optimizer)) before scaler.update()"
            )
        unchecked = [s for s in states if s.agreed is None and s.stage is Stage.READY]
        if any(s.user_found is not None for s in unchecked):
            # torch's update() reads such a flag as it is; dscale agrees on it in the check.
            self._end_iteration(counted=False)
            raise RuntimeError(
                "update(): found_inf_per_device was written for an optimizer that no step() or "
                "unscale_() checked in this iteration (or whose check raised), so no rank agreed "
                "on it and the scale is left as it was. The flag joins the agreement in the "
                "check: call scaler.step(optimizer) or scaler.unscale_(optimizer) before update()"
            )
        if unchecked:
            # A check that raised before it made a flag, with no agreement to join: the peers
            # went on.
            self._end_iteration(counted=False)
            raise RuntimeError(
                "update(): a step() or unscale_() of this iteration raised on this rank before "
                "its inf/NaN check finished, and no agreement ran to tell the other ranks, so "
                "they may have applied their step: the ranks' weights may differ now. Fix what "
                "that error named, then reload the last checkpoint on every rank"
            )

    def _predictive_measured(self, states: list[OptimizerState]) -> None:
        """policy="predictive": hand the iteration's agreed measurement to its rule."""
        assert self._predictive is not None and states[0].layout is not None  # noqa: S101
        host_values = [s.host_agreed for s in states]
        on_host = None if any(v is None for v in host_values) else host_values
        # A step the spike gate skipped measures nothing: its spike stays out of the window.
        self._predictive.begin(
            [_decision.agreed(self, s) for s in states],
            on_host,  # type: ignore[arg-type]
            states[0].layout.start("measured"),
            spiked=[s.spike for s in states if s.spike is not None],
            spiked_on_host=any(s.applied is False and not s.overflowed for s in states),
        )

    def _end_iteration(self, *, counted: bool = True) -> None:
        """Forget the iteration's per-optimizer states and hooks' flags; count it."""
        self._forget_optimizer_states()
        self._hooks.reset()
        # Compiled iterations are not counted: the count would be a per-step number in the
        # traced region (a recompile each step), and they carry the scale range anyway.
        if counted and not torch.compiler.is_compiling():
            self._iteration += 1

    def agreed_scale_range(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(min, max) of the scale over the scaler's ranks in the last update(), as tensors.

        Carried on the step's own agreement collective, so it costs no collective of its own and
        is known on every rank alike; reading it as numbers is a host sync on GPU. The scaler
        carries it on every ``dscale.scaler._program.agreement.RANGE_EVERY``-th update (the
        first included), whatever its policy. None before the first update(), after
        an update whose collective did not carry it, and after an iteration in which no scaler
        collective ran.
        """
        found = self._scale_range
        if isinstance(found, torch.Tensor):
            found = _agreement.scale_range(found)
        elif isinstance(found, str):  # OWN_SCALE, made here rather than on every update
            scale = self._require_scale("agreed_scale_range")
            found = _agreement.ScaleRange(scale, scale)
        self._scale_range = found
        return found

    # ----------------------------------------------------------------- was it applied?
    def step_applied(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Whether the last step() of ``optimizer`` (default: the last one stepped) was applied.

        Known on the host after a plain step(); after a fused or ``sync_free`` step this reads the
        agreed flag (a host sync on GPU), only when you ask.
        """
        if not self._enabled:
            return True
        key = id(optimizer) if optimizer is not None else self._last_stepped
        if key is None or key not in self._outcomes:
            raise RuntimeError("step_applied(): this optimizer has not been stepped by the scaler")
        outcome = self._outcomes[key]
        if isinstance(outcome, torch.Tensor):
            outcome = not bool(outcome.item() > 0)
            self._outcomes[key] = outcome
        return outcome

    def register_step_callback(
        self, callback: Callable[[torch.optim.Optimizer, bool], None]
    ) -> Callable[[], None]:
        """Call ``callback(optimizer, applied)`` after every step(); returns an unregister function.

        For LR schedulers, EMA and step counters that must follow skipped steps. With fused or
        sync-free steps, a registered callback makes step() read the flag (a host sync on GPU).
        """
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback)

    def _stepped_this_iteration(self) -> int:
        """How many optimizers step() stepped since the last update() (dscale.fp8 counts
        iterations by the first)."""
        return sum(s.stage is Stage.STEPPED for s in self._per_optimizer_states.values())

    def add_agreement_field(self, field: _agreement.AgreementField) -> Callable[[], None]:
        """Let ``field`` send values on every step's agreement vector (dscale.fp8's amaxes).

        ``field.values(optimizer)`` gives this rank's values (or None), which ride the one MAX
        all-reduce (NaN sent as +inf); ``field.agreed(slots)`` is handed its slots in the vector
        (see ``dscale.scaler._program.agreement.AgreementField``). Returns an unregister function.
        """
        self._fields.append(field)

        def unregister() -> None:
            if field in self._fields:
                self._fields.remove(field)

        return unregister

    def add_observer(self, observer: GradObserver) -> None:
        """Attach a :class:`GradObserver` (e.g. numerics stats for the metrics exporter)."""
        self._observers.append(observer)

    def remove_observer(self, observer: GradObserver) -> None:
        """Detach an observer added with :meth:`add_observer`."""
        self._observers.remove(observer)

    @contextlib.contextmanager
    def observing(self, *optimizers: torch.optim.Optimizer) -> Iterator[None]:
        """Run the observers eagerly around a compiled ``step()``/``update()`` region.

        A compiled region cannot call an observer's host code, so wrap the call::

            with scaler.observing(optimizer):
                compiled_step()  # scaler.step(optimizer); scaler.update()

        On entry each observer's ``on_grads`` gets each optimizer's grads (still scaled) and the
        scale, as step() would give them before its check; at the end it gets ``on_update`` with
        the update's flag. The observers see what they see eagerly, in the same order, and the
        step is the same with or without them. Works the same around eager calls. A compiled
        step() with observers outside this block runs eagerly (a graph break; under
        ``fullgraph=True`` an error naming this method).
        At the end, with or without observers, it also does what a compiled update() leaves to
        the next eager call: the host copy that ``snapshot(wait=False)`` and the exporter read,
        and the watchdogs.
        """
        if not self._enabled:
            yield
            return
        if not self._observers:
            yield
            self._after_compiled_update()
            return
        if self._observing:
            raise RuntimeError("scaler.observing(): already inside an observing() block")
        self._deliver_observed()  # a compiled update() outside a block: its flag first
        scale = self._require_scale("observing")
        for optimizer in optimizers:
            grads = _unscale.optimizer_grads(optimizer)
            for observer in self._observers:
                observer.on_grads(optimizer, grads, scale)
        self._observing = True
        try:
            yield
        finally:
            self._observing = False
        self._after_compiled_update()  # publishes for scrapes, watchdogs, on_update

    # ----------------------------------------------------------------- inspection
    def counters(self) -> dict[str, torch.Tensor]:
        """The live device tensors (no sync): scale, trackers and event counters.

        Keys: scale, growth_tracker, hysteresis_tracker, steps, skipped_steps, skipped_in_a_row,
        growths, backoffs (and the spike gate's). Brought up to date from the host copy first
        (kernel launches only), so call it from the training thread. Before the first scale()
        the scaler has no device yet: the values come as new CPU tensors, and the scaler stays
        unplaced.
        """
        return _scaler_state.counters(self)

    def snapshot(self, *, wait: bool = True) -> dict[str, float | int]:
        """:meth:`counters` as Python numbers (and predictive's telemetry).

        Free after plain steps (the host holds the state); after fused or ``sync_free`` steps it
        waits for the GPU. ``wait=False`` never waits and never writes, so another thread (a
        metrics scrape) may call it: after device-side updates it returns the newest state whose
        copy has reached the host, which may be an update or two behind.
        """
        return _scaler_state.snapshot(self, wait=wait)

    # ----------------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, Any]:
        """The scaler state: torch's five keys plus dscale's trackers (``_state.format``).

        Empty when disabled. Call it after update(). Waits for the GPU only after fused or
        sync-free steps (otherwise the host holds the state).
        """
        return _scaler_state.state_dict(self) if self._enabled else {}

    def _checked_state(self, state_dict: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
        """What load_state_dict would apply, or ValueError; changes nothing (dscale.checkpoint
        calls it too, so that both ways in make the same checks)."""
        return _scaler_state.checked(self, state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from dscale's or torch's GradScaler; no-op when disabled.

        The dict is validated completely first: a rejected one (ValueError) changes nothing.
        Keys that torch's dict lacks keep this scaler's settings; its trackers start fresh.
        """
        if self._enabled:
            _scaler_state.load(self, state_dict)

    def __getstate__(self) -> dict[str, Any]:
        return _scaler_state.picklable(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        _scaler_state.unpickle(self, state)


GradScaler._optimizer_state_type = OptimizerState
# Under torch.compile, the calls that need the host run eagerly: a graph break, or with
# fullgraph=True torch's error carrying the reason (which names the configuration that compiles).
_EAGER_STEP = {
    reason: torch.compiler.disable(GradScaler._step, reason=reason)
    for reason in _compiled.STEP_REASONS
}
_EAGER_UPDATE = {
    reason: torch.compiler.disable(GradScaler._update, reason=reason)
    for reason in _compiled.UPDATE_REASONS
}
# Scalers pickled before the step path's split (0010076 and earlier) name the per-optimizer
# state's type here (their empty OptimizerStates holds it): unpickling them must find it.
_OptimizerState = OptimizerState


def _is_torch_fused(optimizer: torch.optim.Optimizer) -> bool:
    """One of torch.optim's own fused implementations (whose kernels dscale's tests cover)."""
    module = type(optimizer).__module__
    return module.startswith("torch.optim.") and bool(optimizer.defaults.get("fused"))


def _no_scale_error(funcname: str) -> RuntimeError:
    return RuntimeError(
        f"{funcname}() was called before scale(); call scaler.scale(loss).backward() "
        "earlier in the iteration. Under a pipeline schedule, where a stage without "
        "the loss cannot: build every stage's schedule with "
        "loss_fn=scaler.pipeline_loss(loss_fn) (see docs/scaler.md, 'Pipeline "
        "parallel'); no dummy scale() call is needed then"
    )
