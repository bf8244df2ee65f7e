"""dscale.GradScaler: torch's GradScaler API, with every rank taking the same decision."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import types
import warnings
import weakref
from collections import abc
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any, Literal, Protocol

import torch

from dscale import _agreement, _dist, _policy, _predictive, _predictive_state, _spike_gate, _state
from dscale._grad_measure import mark_overflow
from dscale._masked_step import (
    ids_with_state,
    masked_step,
    remove_state_created_by_skipped_step,
    state_created_since,
)
from dscale._policy import COUNTER_NAMES
from dscale._reduction_hooks import AttachRefusal, ReductionHooks
from dscale._scale_state import ScaleState, fresh_host_state
from dscale._torch_compat import TorchGradScalerSurface
from dscale._unscale import (
    check_and_unscale_,
    copy_to,
    group_by_device_and_dtype,
    optimizer_grads,
)
from dscale._warnings import warn_if_scaling_is_not_needed

logger = logging.getLogger(__name__)

StuckPolicy = Literal["raise", "warn"]
# Grads that a fused optimizer's check may unscale in place without losing small values.
_FULL_PRECISION = (torch.float32, torch.float64)


class ScaleCollapsedError(RuntimeError):
    """The scale sits at ``min_scale`` and steps keep overflowing (``on_stuck_at_min="raise"``)."""


class GradObserver(Protocol):
    """Something that watches the gradients and outcomes (e.g. ``dscale.stats``)."""

    def on_grads(
        self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], scale: torch.Tensor
    ) -> None:
        """Called with the rank-local, still scaled grads right before the check; no host sync."""

    def on_update(self, scaler: GradScaler, found_inf: torch.Tensor) -> None:
        """Called at the end of every update() with the agreed flag (> 0: the step was skipped)."""


class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclasses.dataclass
class _OptimizerState:
    stage: _Stage = _Stage.READY
    # This rank's agreement vector (_agreement.FIELDS), then the agreed one once `work` is done.
    agreed: torch.Tensor | None = None
    work: Any = None  # pending all-reduce
    over_group: bool = False  # whether `agreed` was reduced over the scaler's group
    lone: bool = False  # whether the scaler had no process group (one process) at the check
    # Checked by step() before a step(grad_scaler=...) optimizer ran: its unscale_() then only
    # marks the stage (the check ran, and unscaled what it had to).
    prechecked: bool = False
    applied: bool | None = None  # known on the host when step() synced for its decision
    host_agreed: list[float] | None = None  # the agreed vector, read in that same sync
    # A rank-local flag written by code made for torch's scaler (["found_inf_per_device"]).
    user_found: torch.Tensor | None = None
    overflowed: bool | None = None  # with `applied`: whether the skip was for inf/NaN grads
    # The spike gate (dscale/_spike_gate.py): the length of its part of `agreed`, and once
    # decided the spike flag, the step's values and the skip flag (overflow or spike).
    tail_len: int = 0
    spike: torch.Tensor | None = None
    spike_values: torch.Tensor | None = None
    skip: torch.Tensor | None = None
    # attach(): the backward passes through the models holding the optimizer's parameters when
    # it was checked; one more before its step means grads the check never saw.
    backwards: tuple[int, ...] = ()
    # unscale_(): the agreement waits for the first read of the flag, so that a flag torch-shaped
    # code writes in between (`late_found`) takes effect on every rank. `deferred`: not started
    # yet; `deferred_group`: the group it then runs over (None: none).
    deferred: bool = False
    deferred_group: Any = None
    late_found: torch.Tensor | None = None
    refused: Exception | None = None  # raised once this rank has joined the deferred agreement


# Under torch.compile the scaler's calls run eagerly (a graph break each, as torch's own scaler
# gets): they read process groups, device state and host decisions that dynamo cannot trace.
_eager = torch.compiler.disable


class _NoGrad:
    """``torch.no_grad()`` at a third of its cost (1.3 us there): the check runs every step."""

    __slots__ = ("enabled",)

    def __enter__(self) -> None:
        self.enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch._C._set_grad_enabled(self.enabled)


#: :meth:`GradScaler.agreed_scale_range` of an iteration with no group: the scale itself.
_OWN_SCALE = "own scale"


# issue 13: a subclass of torch.amp.GradScaler; torch's internals are answered in _torch_compat.
class GradScaler(TorchGradScalerSurface):
    """Dynamic loss scaler for fp16 training that keeps every rank in agreement.

    A drop-in for ``torch.amp.GradScaler``: same arguments, methods and state dict. Each rank checks
    its own gradients (the local shard under FSDP) for inf/NaN in one fused pass per device and
    dtype; the one-element overflow flag is then all-reduced (MAX) once per optimizer step, so all
    ranks skip, grow or back off together even when only one rank's shard overflowed.

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
            (set it from the measured gradient range; see ``dscale._predictive``). A predictive
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
        )
        if min_scale is not None and init_scale < min_scale:
            raise ValueError(f"init_scale={init_scale!r} is below min_scale={min_scale!r}")
        if max_scale is not None and init_scale > max_scale:
            raise ValueError(f"init_scale={init_scale!r} is above max_scale={max_scale!r}")
        if on_stuck_at_min not in ("raise", "warn"):
            raise ValueError(f"on_stuck_at_min must be 'raise' or 'warn', got {on_stuck_at_min!r}")
        if (
            not isinstance(stuck_patience, int)
            or isinstance(stuck_patience, bool)
            or (stuck_patience < 1)
        ):
            raise ValueError(f"stuck_patience must be an int >= 1, got {stuck_patience!r}")
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
        # policy="predictive" (dscale/_predictive.py): its measurement and state, else None.
        self._predictive = None
        tail = 0
        if policy == "predictive":
            window = predictive_window or _predictive_state.DEFAULT_WINDOW
            # Overflows are remembered as long as the dynamic rule stays backed off.
            self._predictive = _predictive_state.PredictiveScaling(window, growth_interval)
            init_scale = _predictive.first_scale(init_scale, min_scale, max_scale)
            tail = _predictive_state.tail_words(window, growth_interval)
        self._book = ScaleState(fresh_host_state(float(init_scale), hysteresis), tail)
        self._placed_init_scale = float(init_scale)  # torch's _init_scale, once placed
        self._per_optimizer_states: dict[int, _OptimizerState] = {}
        self._outcomes: dict[int, bool | torch.Tensor] = {}
        self._last_stepped: int | None = None
        self._callbacks: list[Callable[[torch.optim.Optimizer, bool], None]] = []
        self._fields: list[_agreement.AgreementField] = []  # features' fields (dscale.fp8)
        self._observers: list[GradObserver] = []
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
        self._inv_scale: tuple[float, torch.Tensor] | None = None  # (scale, 1/scale)
        self._one: torch.Tensor | None = None
        # False for a StepGuard (dscale/step_guard.py): the scale is 1 and never moves.
        self._loss_scaling = True
        self._spike_warned_at = 0  # the spike run length last warned about
        self._spike = (
            _spike_gate.SpikeGate(
                signals, sigma=spike_sigma, window=spike_window, warmup=spike_warmup
            )
            if signals
            else None
        )

    # ----------------------------------------------------------------- device state
    def _scale_on(self, device: torch.device) -> torch.Tensor:
        if self._book.scale is None:
            self._book.place(device)
        assert self._book.scale is not None  # noqa: S101 - placed just above
        return self._book.scale

    def _require_scale(self, funcname: str) -> torch.Tensor:
        if self._book.scale is None:
            raise RuntimeError(
                f"{funcname}() was called before scale(); call scaler.scale(loss).backward() "
                "earlier in the iteration"
            )
        return self._book.scale

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
        self._scale_calls += 1  # attach()'s hooks refuse a backward with no scale() before it
        if self._spike is not None:
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
        self._require_scale("unscale_")
        state = self._per_optimizer_states.setdefault(id(optimizer), _OptimizerState())
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(). "
                "Call unscale_(optimizer) at most once per iteration, between backward() and "
                "step(optimizer), then update() once after step()"
            )
        if state.stage is _Stage.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(). Call unscale_(optimizer) before "
                "step(optimizer) (to clip the gradients), or not at all: step() unscales"
            )
        if not state.prechecked:
            self._check(optimizer, state, unscale=True, defer=True)
        state.stage = _Stage.UNSCALED

    def _check(
        self,
        optimizer: torch.optim.Optimizer,
        state: _OptimizerState,
        *,
        unscale: bool | None,
        unscaled_by_caller: bool = False,
        defer: bool = False,
    ) -> bool:
        """Grads -> observers -> flag -> agree; True when the grads are unscaled afterwards.

        The hooks report which of ``optimizer``'s grads they already unscaled and checked (and
        whether their flag is global); this rank's pass takes the rest, and the agreement
        vector goes out once, unless the hooks' flag already covers everything on every rank.
        ``unscaled_by_caller``: code written for torch's scaler unscaled the grads itself.
        ``defer``: start the agreement when the flag is first read (:meth:`_agreed`).
        """
        scale = self._require_scale("unscale_")
        group = self._process_group()
        state.lone = group is None
        if self._spike is not None and len(self._per_optimizer_states) > 1:
            raise RuntimeError(
                "the spike gate decides once per iteration on the loss and the grad norm, but a "
                "second optimizer was checked in this iteration; with several optimizers use "
                "one GradScaler per optimizer, or turn the spike gate off (spike_signals=())"
            )
        try:
            report = self._hooks.report(optimizer, group, scale.device)
            if unscaled_by_caller and report.covered:
                # torch's in-place unscale kernel leaves the grads' versions as they were, so
                # the hooks cannot see this write: the stage says it.
                twice = AttachRefusal(
                    f"attach(): the grads of {len(report.covered)} parameter(s) were unscaled in "
                    "the attached model's reduction, and code written for torch's scaler marked "
                    "them unscaled itself (['stage'] = OptState.UNSCALED): it divided them a "
                    "second time. Let the scaler unscale them (scaler.unscale_(optimizer)), or do "
                    "not attach() this model"
                )
                twice.peers_agree = not report.is_global  # as the hooks' own refusals
                state.stage = _Stage.READY  # the next iteration's code says it again, or not
                raise twice
        except AttachRefusal as exc:
            # The peers run the agreement where the flag is not global, and also where a spike
            # gate or a flag written by torch-shaped code keeps it (below): join it with a refusal,
            # so that they skip rather than wait on us.
            kept = self._spike is not None or state.user_found is not None
            if (exc.peers_agree or kept) and group is not None:
                device = _dist.flag_device(group, scale.device)
                # As long as the peers' vectors (policy="predictive" adds its measurement).
                refusal = _agreement.agreement_vector(
                    torch.ones((), device=device),
                    copy_to(scale, device),
                    self._refused_measurement(device),
                    with_range=self._carries_range(),
                )
                for extra in self._fields:  # as long as the peers'
                    refusal = extra.append_to(refusal, optimizer)
                if self._spike is not None:  # as long as the peers' (our slots: -inf)
                    width = len(self._spike.signals) * _dist.world_size(group)
                    blank = torch.full((width,), -math.inf, device=device)
                    refusal = torch.cat([refusal, blank])
                if defer:
                    # unscale_(): the peers agree at the flag's first read, after any collective
                    # of the user's in between (FSDP's clip_grad_norm_): join there, then raise.
                    state.agreed, state.refused = refusal, exc
                    state.deferred, state.deferred_group = True, group
                    return True
                _agreement.all_reduce_flag(refusal, group).wait()
                # This rank now holds what its peers agreed on (a skip): update() backs off as
                # theirs does, and a second step() raises instead of waiting alone in a collective.
                state.agreed, state.over_group, state.stage = refusal, True, _Stage.STEPPED
            raise
        state.backwards = report.backwards
        # attach(): nothing left for this rank's pass where the hooks checked every grad.
        grads = [] if report.complete else optimizer_grads(optimizer, set(report.covered))
        groups = group_by_device_and_dtype(grads)
        if unscale is None:  # a fused optimizer, which can unscale in its own kernel
            # Where the host decides (the CPU), the check writes every grad anyway, so unscaling
            # there is free and spares the fused kernel its own division (an extra pass on the
            # CPU). On a GPU the kernel's division costs nothing, while 1/scale would cost three
            # launches: the kernel unscales, as with torch. fp16/bf16 grads stay scaled:
            # unscaled in their own storage, small values would flush to zero. Only at a
            # power-of-two scale is a product with f32(1/scale) the kernel's division exactly.
            unscale = (
                self._decides_on_host(scale)
                and _is_power_of_two(self._book.host)
                and all(d in _FULL_PRECISION for per_dtype in groups.values() for d in per_dtype)
            )
        unscale = unscale or report.unscaled  # the pass must match what the hooks did
        if not self._loss_scaling:
            unscale = True  # the scale is 1: checked grads are unscaled grads
        for observer in self._observers:
            observer.on_grads(optimizer, grads, scale)
        if report.is_global and self._spike is None and state.user_found is None:
            # DDP's own all-reduce over a group covering ours made the flag global. (The spike
            # gate still needs the loss and grad norm of every rank, and a flag written by
            # torch-shaped code is this rank's own: they keep the collective. Every rank runs the
            # same code, so every rank writes one, whatever its value.)
            group = None
        device = scale.device if group is None else _dist.flag_device(group, scale.device)
        host = self._book.host
        with _NoGrad():
            state.agreed = _agreement.blank_vector(
                scale,
                None if host is None else host.scale,
                device,
                measured=self._predictive is not None,
                with_range=self._carries_range(),
            )
            checked = None  # on the CPU, predictive's measurement also says inf/NaN
            if self._predictive is not None:  # policy="predictive": measure before the unscale
                at = _agreement.measured_at(self._carries_range())
                checked = self._predictive.measure.write(state.agreed, at, groups, report.measured)
            flag = state.agreed[_agreement.OVERFLOW]  # a view: the check writes the flag into it
            if groups:  # none left when attach()'s hooks checked every grad: no 1/scale either
                inv_scale = self._unscale_factor(scale) if unscale else self._unit(scale)
                check_and_unscale_(groups, inv_scale, flag, None if unscale else checked)
            written = bool(groups)  # whether the flag holds a check's result yet (else 0)
            # MAX of flags as 0 or 1, not +: torch's fused kernels skip only where found_inf == 1
            # exactly, and a user's flag may say 2 (or -1, which torch's update reads as found).
            for other in (report.flag, state.user_found):
                if other is not None:
                    other = copy_to(other, device).reshape(())
                    if written:
                        torch.maximum(flag, (other > 0).float(), out=flag)
                    else:  # flag is 0: (other > 0) in one op (heaviside at 0 takes flag's 0)
                        torch.heaviside(other.float(), flag, out=flag)
                        written = True
                    if self._predictive is not None:
                        mark_overflow(
                            state.agreed, _agreement.measured_at(self._carries_range()), other
                        )
            for extra in self._fields:  # registered fields, before the spike gate's tail
                state.agreed = extra.append_to(state.agreed, optimizer)
            if self._spike is not None:  # this rank's loss and grad norm, in its own slots
                every = optimizer_grads(optimizer) if report.covered else grads
                carried = None if unscale else scale  # None: unscaled grads
                tail = self._spike.tail(
                    every, carried, device, _dist.rank(group), _dist.world_size(group)
                )
                state.tail_len = tail.numel()
                state.agreed = torch.cat([state.agreed, tail])
        state.over_group = group is not None
        if defer:
            state.deferred, state.deferred_group = True, group
        else:
            state.work = None if group is None else _agreement.all_reduce_flag(state.agreed, group)
        return unscale

    def _start_deferred(self, state: _OptimizerState) -> None:
        """Start the agreement unscale_() left for later, with a flag written since then.

        The written flag joins this rank's as torch's would (MAX: it adds a found overflow, it
        cannot hide one). Under attach(), where DDP's reduction made the flag global, a written
        flag keeps the collective, as one written before unscale_() does: every rank then writes.
        """
        state.deferred = False
        group, state.deferred_group = state.deferred_group, None
        late, state.late_found = state.late_found, None
        assert state.agreed is not None  # noqa: S101 - set by the check that deferred
        if state.refused is not None:  # the refusal vector: join the peers' agreement, raise
            refused, state.refused = state.refused, None
            _agreement.all_reduce_flag(state.agreed, group).wait()
            raise refused
        if late is not None:
            with _NoGrad():
                flag = state.agreed[_agreement.OVERFLOW]
                late = copy_to(late, flag.device).reshape(())
                torch.maximum(flag, (late > 0).float(), out=flag)
                if self._predictive is not None:
                    at = _agreement.measured_at(self._carries_range())
                    mark_overflow(state.agreed, at, late)
            if group is None:
                group = self._process_group()
                if group is not None:
                    scale = self._require_scale("step")
                    state.agreed = copy_to(state.agreed, _dist.flag_device(group, scale.device))
        if group is not None:
            state.over_group = True
            state.work = _agreement.all_reduce_flag(state.agreed, group)

    def _decides_on_host(self, agreed: torch.Tensor) -> bool:
        """Whether fused and sync-free steps read the agreed flag on the host (``agreed``'s device).

        On the CPU the flag is already in host memory: reading it costs nothing, and deciding on
        the host makes update() plain arithmetic instead of tensor ops. Tests and the op-count
        benchmark turn ``_read_host_flags`` off to run the device-side path, as on CUDA.
        """
        return agreed.device.type == "cpu" and self._read_host_flags

    def _carries_range(self) -> bool:
        """Whether this iteration's vector carries the scale fields (see ``_agreement``).

        Always with the spike gate: its slots follow the scale fields, at a fixed place.
        """
        return _agreement.carries_range(self._iteration) or self._spike is not None

    def _unscale_factor(self, scale: torch.Tensor) -> torch.Tensor:
        """1/scale as a tensor, made once per scale value while the host knows the scale."""
        host = self._book.host
        if host is None:  # the reciprocal in fp64, as torch does: fp32 division can be imprecise
            return scale.double().reciprocal().float()
        cached = self._inv_scale
        if cached is None or cached[0] != host.scale or cached[1].device != scale.device:
            # The same fp64 reciprocal rounded once to fp32 (inf for a scale that underflowed).
            inverse = _policy.f32(1.0 / host.scale) if host.scale else math.inf
            cached = (host.scale, torch.full((), inverse, device=scale.device))
            self._inv_scale = cached
        return cached[1]

    def _unit(self, scale: torch.Tensor) -> torch.Tensor:
        """A 1.0 to check without unscaling (fused optimizers unscale in their own kernel)."""
        if self._one is None or self._one.device != scale.device:
            self._one = torch.ones_like(scale)
        return self._one

    def _refused_measurement(self, device: torch.device) -> torch.Tensor | None:
        """policy="predictive": a refusing rank's measurement, an overflow's; else None."""
        if self._predictive is None:
            return None
        return torch.tensor([_predictive.OVERFLOW_MARK, 0.0], device=device)

    # ----------------------------------------------------------------- reduction hooks
    def attach(self, model: torch.nn.Module) -> None:
        """Fold the unscale and the inf/NaN check into the model's gradient reduction.

        DDP: replaces the comm hook; each bucket is averaged, unscaled and checked in one pass
        while it is hot, so step() does no unscale pass and the scaler adds no collective for
        this model's parameters. FSDP2 (``fully_shard``): each reduce-scatter output is unscaled
        and checked in an all-reduce hook; the one-element flag all-reduce stays. Either way the
        flag covers the whole model: an overflow anywhere in it skips every optimizer over its
        parameters. Call once, before the first backward.
        """
        if self._enabled:
            measure = None if self._predictive is None else self._predictive.measure
            self._hooks.attach(
                model,
                lambda: self._require_scale("backward"),
                lambda: self._scale_calls,
                measure,
            )

    def _agreed(self, state: _OptimizerState) -> torch.Tensor:
        """The agreed vector of ``state`` on the scale's device (waits for the collective)."""
        if state.deferred:
            self._start_deferred(state)
        if state.work is not None:
            state.work.wait()
            state.work = None
        assert state.agreed is not None  # noqa: S101 - set by _check
        scale = self._require_scale("step")
        if state.agreed.device != scale.device:
            state.agreed = copy_to(state.agreed, scale.device)
        return state.agreed

    def _agreed_flag(self, state: _OptimizerState) -> torch.Tensor:
        return self._agreed(state)[_agreement.OVERFLOW]

    def _skip_flag(self, state: _OptimizerState) -> torch.Tensor:
        """The flag the step obeys (> 0: skip): the overflow flag, or with the spike gate on the
        larger of it and the gate's decision (0 or 1 either way: fused kernels test == 1)."""
        agreed = self._agreed(state)
        flag = agreed[_agreement.OVERFLOW]
        if self._spike is None:
            return flag
        if state.skip is None:
            tail = agreed[agreed.numel() - state.tail_len :]
            state.spike, state.spike_values = self._spike.decide(tail, flag)
            state.skip = torch.maximum(flag, state.spike.to(flag.dtype))
        return state.skip

    def _decide_on_host(self, state: _OptimizerState) -> bool:
        """Read the agreed vector on the host (one sync on GPU): whether the step is applied.

        The whole (small) vector comes in that one copy: policy="predictive" uses its
        measurement, and the scale range is then known on the host too (and the spike gate's
        decision, appended to it).
        """
        agreed = self._agreed(state)
        spike = False
        if self._spike is not None:
            self._skip_flag(state)
            assert state.spike is not None  # noqa: S101 - decided just above
            values = torch.cat([agreed, state.spike.reshape(1).to(agreed.dtype)]).tolist()
            state.host_agreed, spike = values[:-1], values[-1] > 0
        else:
            state.host_agreed = agreed.tolist()
        state.overflowed = state.host_agreed[_agreement.OVERFLOW] > 0
        state.applied = not (state.overflowed or spike)
        return state.applied

    @_eager
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done), agree across ranks, then step unless some rank overflowed.

        Returns the optimizer's return value, or None when the step was skipped. With a plain or
        foreach optimizer the skip decision reads the agreed flag (one host sync, as torch); fused
        optimizers (``_step_supports_amp_scaling``) and ``sync_free=True`` decide on the device,
        except on the CPU, where the flag is in host memory already and is read there for free.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError(
                "Closure use is not currently supported if GradScaler is enabled: call "
                "scaler.scale(loss).backward() yourself, then scaler.step(optimizer)."
            )
        self._require_scale("step")
        state = self._per_optimizer_states.setdefault(id(optimizer), _OptimizerState())
        if state.stage is _Stage.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(). Call step(optimizer) "
                "once per optimizer per iteration, then update() once after step()"
            )
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        if fused and _takes_grad_scaler(optimizer):
            if self._spike is not None:
                raise ValueError(
                    f"{type(optimizer).__name__}.step(grad_scaler=...) checks its grads itself and "
                    "skips on the overflow flag only, so the spike gate cannot skip its steps; "
                    "turn the gate off (spike_signals=()) for this optimizer"
                )
            retval = self._step_passing_self(optimizer, state, args, kwargs)
            return self._stepped(optimizer, state, retval)
        was_unscaled = state.stage is _Stage.UNSCALED
        if state.stage is _Stage.READY:
            # Unscaling in the check pass instead of the fused kernel is proven bit-identical
            # (the differential matrices) for torch.optim's own fused kernels only; any other
            # optimizer that does its own scaling gets the grads still scaled, as from torch.
            unscale = (None if _is_torch_fused(optimizer) else False) if fused else True
            was_unscaled = self._check(optimizer, state, unscale=unscale)
        elif state.agreed is None:  # marked UNSCALED by code that unscaled the grads itself
            self._check(optimizer, state, unscale=False, unscaled_by_caller=True)
        else:
            self._refuse_a_backward_since_unscale(optimizer, state)
        agreed = self._agreed(state)
        on_host = self._decides_on_host(agreed)

        if fused:
            flag = self._skip_flag(state)
            scale = self._require_scale("step")
            # torch's contract: the product with a grad_scale the user set, None once unscaled.
            own = getattr(optimizer, "grad_scale", None)
            grad_scale = (
                own
                if was_unscaled or not self._loss_scaling
                else (scale if own is None else scale * own)
            )
            optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
            optimizer.found_inf = flag  # type: ignore[attr-defined]
            before = ids_with_state(optimizer)
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
            fresh = state_created_since(optimizer, before)
            if fresh:
                remove_state_created_by_skipped_step(optimizer, fresh, flag)
            self._outcomes[id(optimizer)] = self._decide_on_host(state) if on_host else flag
        elif self._sync_free and not on_host:
            flag = self._skip_flag(state)
            retval = masked_step(optimizer, flag, lambda: optimizer.step(*args, **kwargs))
            self._outcomes[id(optimizer)] = flag
        else:
            applied = self._decide_on_host(state)  # the host sync the skip decision needs
            retval = optimizer.step(*args, **kwargs) if applied else None
            self._outcomes[id(optimizer)] = applied
        return self._stepped(optimizer, state, retval)

    def _refuse_a_backward_since_unscale(
        self, optimizer: torch.optim.Optimizer, state: _OptimizerState
    ) -> None:
        """attach(): raise if a backward changed ``optimizer``'s grads after unscale_() checked."""
        if not state.backwards or self._hooks.backwards(optimizer) == state.backwards:
            return
        # A backward through DDP or FSDP2 is collective, so every rank refuses here alike. One
        # outside the reduction (no_sync(), the bare module) may run on one rank only: the
        # agreement unscale_() left pending then goes out marked overflowed, so that the
        # peers skip rather than wait in it. Nothing is applied here either way. (Where no
        # collective runs, the flag is left as it is: nothing can reach the peers.)
        mine = state.agreed
        if state.deferred and (state.deferred_group is not None or state.late_found is not None):
            assert mine is not None  # noqa: S101 - set by the check that deferred
            with _NoGrad():
                mine[_agreement.OVERFLOW].fill_(1.0)
                if self._predictive is not None:
                    at = _agreement.measured_at(self._carries_range())
                    mark_overflow(mine, at, torch.ones((), device=mine.device))
            self._agreed(state)
        raise RuntimeError(
            "attach(): a backward pass ran through the attached model (or, outside its "
            "reduction, through its parameters) after scaler.unscale_(optimizer) and before "
            "scaler.step(optimizer); the flag that "
            "unscale_() agreed on does not cover the grads it added, so the step is refused. "
            "Call scaler.unscale_(optimizer) after the last backward before the step"
        )

    def _stepped(
        self, optimizer: torch.optim.Optimizer, state: _OptimizerState, retval: Any
    ) -> Any:
        state.stage = _Stage.STEPPED
        self._last_stepped = id(optimizer)
        for callback in self._callbacks:
            callback(optimizer, self.step_applied(optimizer))
        return retval

    def _step_passing_self(
        self,
        optimizer: torch.optim.Optimizer,
        state: _OptimizerState,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """torch's older contract: ``optimizer.step(grad_scaler=self)``, the optimizer checks.

        Such an optimizer (apex's and Transformer Engine's capturable fused ones) asks
        ``_check_inf_per_device(self)`` (or calls ``unscale_``) and ``_get_scale_async()``, unscales
        and skips in its own kernel. What it reads here is the flag agreed by every rank, so every
        rank's optimizer skips alike.
        """
        warnings.warn(
            "GradScaler is going to stop passing itself as a keyword argument to the passed "
            "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
            "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
            FutureWarning,
            stacklevel=3,
        )
        before = ids_with_state(optimizer)
        # attach(): the hooks unscaled grads in the reduction (and the check unscales the rest
        # to match). Check now, whatever order the optimizer asks in, so that it reads a scale
        # of 1 from _get_scale_async() instead of dividing a second time.
        scale = self._require_scale("step")
        if state.agreed is None and self._hooks.reduced(optimizer):
            unscaled = self._check(optimizer, state, unscale=False)
            assert unscaled  # noqa: S101 - the hooks reduced: the check unscales what they did not
            state.prechecked = True  # an unscale_() from the optimizer has nothing left to do
            self._scale_for_step = self._unit(scale)
        if state.stage is _Stage.UNSCALED and state.agreed is not None:
            self._refuse_a_backward_since_unscale(optimizer, state)  # as step() does
        step: Any = optimizer.step  # takes grad_scaler= (checked by _takes_grad_scaler)
        self._stepping = id(optimizer)
        try:
            retval = step(*args, grad_scaler=self, **kwargs)
        finally:
            self._scale_for_step = None
            self._stepping = None
        if state.agreed is None:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step(grad_scaler=...) never checked its grads: it "
                "must call grad_scaler._check_inf_per_device(optimizer) or "
                "grad_scaler.unscale_(optimizer), so that update() knows whether it skipped"
            )
        flag = self._agreed_flag(state)
        fresh = state_created_since(optimizer, before)
        if fresh:
            remove_state_created_by_skipped_step(optimizer, fresh, flag)
        on_host = self._decides_on_host(flag)
        self._outcomes[id(optimizer)] = self._decide_on_host(state) if on_host else flag
        return retval

    def _agree_now(self, optimizer: torch.optim.Optimizer) -> None:
        """Start the agreement that unscale_() left for later, where every rank reads the flag.

        That is inside ``optimizer``'s step(grad_scaler=...) (it reads the flag it skips on).
        Elsewhere a read may come from one rank only (a log line on rank 0): started there
        alone, the all-reduce would pair with the peers' next collective (a user's
        clip_grad_norm_ before step()) and the ranks would hang. It gets this rank's flag then,
        as from torch's scaler, and the ranks agree in step() or update().
        """
        if self._stepping != id(optimizer):
            return
        state = self._per_optimizer_states.get(id(optimizer))
        if state is not None and state.deferred:
            self._start_deferred(state)

    @_eager
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
        """torch's check without unscaling, for optimizers that unscale themselves: ``{device:
        flag}``, the flag agreed by every rank (the agreement runs here; no host sync).

        Agreed inside ``optimizer``'s step(grad_scaler=...), where every rank asks. Called
        elsewhere (it may be on one rank only), it checks this rank's grads, as torch's does, and
        changes nothing the step will do: a collective started there alone would leave the
        ranks' collectives out of step.
        """
        self._require_scale("_check_inf_per_device")
        state = self._per_optimizer_states.get(id(optimizer))
        if self._stepping != id(optimizer) and (state is None or state.agreed is None):
            return _local_flags(optimizer)
        state = self._per_optimizer_states.setdefault(id(optimizer), _OptimizerState())
        if state.agreed is None:
            self._check(optimizer, state, unscale=False)
        return self._found_inf_per_device(optimizer)

    @_eager
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Grow, keep or back off the scale once for this iteration, on every rank alike.

        Call once per iteration after step() for all optimizers. ``new_scale`` (a float or a
        one-element tensor) sets the scale directly instead. No host sync: after plain steps the
        decision is already known on the host and the update is host arithmetic.
        """
        if not self._enabled:
            return
        self._require_scale("update")
        if new_scale is not None:
            if not self._loss_scaling:
                raise RuntimeError(
                    "update(new_scale=...) on a StepGuard: it does not scale the loss, so it has "
                    "no scale to set; call update() with no argument"
                )
            self._end_spike_iteration(list(self._per_optimizer_states.values()))
            self._book.set_scale(_checked_new_scale(new_scale))
            if self._predictive is not None:
                self._predictive.skip_iteration()
            self._forget_optimizer_states()
            self._hooks.reset()
            self._iteration += 1
            return
        states = list(self._per_optimizer_states.values())
        if not states:
            raise RuntimeError(
                "update() found no inf checks since the last update(): call "
                "scaler.step(optimizer) (or scaler.unscale_(optimizer)) before scaler.update()"
            )
        if any(
            s.agreed is None and s.user_found is None and s.stage is _Stage.READY for s in states
        ):
            # A check that raised before it made a flag, with no agreement to join (attach()'s
            # refusal where DDP's reduction made the flag global): the peers went on.
            self._forget_optimizer_states()
            self._hooks.reset()
            raise RuntimeError(
                "update(): a step() or unscale_() of this iteration raised on this rank before "
                "its inf/NaN check finished, and no agreement ran to tell the other ranks, so "
                "they may have applied their step: the ranks' weights may differ now. Fix what "
                "that error named, then reload the last checkpoint on every rank"
            )
        refused = None
        for state in states:
            if state.deferred:  # unscale_() without step(): agree on it now
                try:
                    self._start_deferred(state)
                except AttachRefusal as exc:
                    # This rank joined its peers' agreement (a skip): update as they do, then
                    # raise, so that the next iteration starts on every rank alike.
                    refused = exc
        self._scale_range = self._range_over_group(states)
        known = all(s.applied is not None for s in states)
        # Overflows only: a step the spike gate skipped is no reason to back off the scale.
        skipped = any(s.overflowed for s in states) if known else None
        # The flag as a tensor only where it is used: a device-side update, or observers.
        on_device = not known or self._book.host is None
        found = self._found(states) if on_device or self._observers else None
        skip_flag = self._end_spike_iteration(states)
        if self._predictive is not None:  # policy="predictive": this iteration's measurement
            host_values = [s.host_agreed for s in states]
            on_host = None if any(v is None for v in host_values) else host_values
            at = _agreement.measured_at(self._carries_range())
            # A step the spike gate skipped measures nothing: its spike stays out of the window.
            spiked = [s.spike for s in states if s.spike is not None]
            self._predictive.begin(
                [self._agreed(s) for s in states],
                on_host,  # type: ignore[arg-type]
                at,
                spiked=spiked,
                spiked_on_host=any(s.applied is False and not s.overflowed for s in states),
            )
        self._book.update(
            self._policy, found, skipped, self._predictive, pinned=not self._loss_scaling
        )
        self._forget_optimizer_states()
        self._hooks.reset()
        self._iteration += 1
        self._watch_for_collapse()
        self._watch_spikes()
        if skip_flag is not None and found is not None:
            found = skip_flag  # observers hear "the step was skipped", for a spike too
        for observer in self._observers:
            observer.on_update(self, found)  # type: ignore[arg-type]
        if refused is not None:
            raise refused

    def _end_spike_iteration(self, states: list[_OptimizerState]) -> torch.Tensor | None:
        """The spike gate's end of an iteration: the window and counters; the skip flag."""
        if self._spike is None:
            return None
        skip = None
        for state in states:
            if state.spike is not None and state.spike_values is not None:
                assert state.skip is not None  # noqa: S101 - decided with the spike
                self._spike.push(state.spike_values, state.spike, state.skip)
                skip = state.skip
        self._spike.end_iteration()
        return skip

    def _found(self, states: list[_OptimizerState]) -> torch.Tensor:
        """The iteration's agreed flag on the scale's device (> 0: some step overflowed)."""
        flags = [self._agreed_flag(s) for s in states]
        return flags[0] if len(flags) == 1 else torch.stack(flags).amax()  # stays 0 or 1

    def _watch_for_collapse(self) -> None:
        """Act on a scale stuck at min_scale; after device-side updates, checks every N steps."""
        if self._policy.min_scale is None:
            return
        if self._book.host is None:
            self._updates_since_stuck_check += 1
            if self._updates_since_stuck_check < self._stuck_patience:
                return
            self._updates_since_stuck_check = 0
        state = self._book.read()  # free while the host holds the state
        in_a_row = state.counters[_policy.SKIPPED_IN_A_ROW]
        if state.scale > self._policy.min_scale or in_a_row < self._stuck_patience:
            return
        if not self._loss_scaling:  # a StepGuard: no scale to blame
            logger.warning(
                "the last %d steps in a row were skipped for inf/NaN gradients on some rank (the "
                "latest at step index %d): look for the parameters with non-finite grads "
                "(dscale_nonfinite_grads_total) or a diverged loss",
                in_a_row,
                state.counters[_policy.STEPS] - 1,
            )
            return
        message = (
            f"loss scale is stuck at min_scale={self._policy.min_scale:g}: the last {in_a_row} "
            f"steps in a row were skipped for inf/NaN gradients (the latest at step index "
            f"{state.counters[_policy.STEPS] - 1}). The gradients overflow even at the smallest "
            "scale: look "
            "for the parameters with non-finite grads (dscale_nonfinite_grads_total) or a "
            "diverged loss, or lower min_scale."
        )
        if self._on_stuck_at_min == "raise":
            raise ScaleCollapsedError(message)
        logger.warning("%s", message)

    def _watch_spikes(self) -> None:
        """Warn when the spike gate has skipped ``stuck_patience`` steps in a row."""
        if self._spike is None:
            return
        # The newest counters the host holds (no wait): a warning may come a step or two late.
        in_a_row = int(self._spike.snapshot(wait=False)["spike_skipped_in_a_row"])
        if in_a_row < self._stuck_patience:
            self._spike_warned_at = 0
        elif in_a_row >= self._spike_warned_at + self._stuck_patience:
            self._spike_warned_at = in_a_row
            logger.warning(
                "the spike gate skipped the last %d steps in a row: the loss or grad norm has "
                "stayed above the window's mean + %g standard deviations. Skipped values never "
                "enter the window, so a lasting change of level is skipped for good: raise "
                "spike_sigma, or load a state dict without the spike_* keys to start a fresh "
                "window",
                in_a_row,
                self._spike.sigma,
            )

    def _range_over_group(self, states: list[_OptimizerState]) -> torch.Tensor | str | None:
        """Min and max scale over the group from this iteration's collective, if it carried them.

        After a collective: its agreed vector, turned into the range only when asked for (None
        then if it was the flag alone).
        """
        for state in states:
            if state.over_group:
                return self._agreed(state) if self._carries_range() else None
        if all(state.lone for state in states):  # one process: its own scale is the whole range
            return _OWN_SCALE
        return None  # the DDP hook's reduction made the flag global: no scaler collective ran

    def agreed_scale_range(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(min, max) of the scale over the scaler's ranks in the last update(), as tensors.

        Carried on the step's own agreement collective, so it costs no collective of its own and
        is known on every rank alike; reading it as numbers is a host sync on GPU. The scaler
        carries it on every ``dscale._agreement.RANGE_EVERY``-th update (the first included),
        whatever its policy. None before the first update(), after
        an update whose collective did not carry it, and after an iteration in which no scaler
        collective ran (a DDP model under ``attach()`` whose reduction made the flag global).
        """
        found = self._scale_range
        if isinstance(found, torch.Tensor):
            found = _agreement.scale_range(found)
        elif isinstance(found, str):  # _OWN_SCALE, made here rather than on every update
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

    def add_agreement_field(self, field: _agreement.AgreementField) -> Callable[[], None]:
        """Let ``field`` append values to every step's agreement vector (dscale.fp8's amaxes).

        Its values ride the one MAX all-reduce (NaN sent as +inf); returns an unregister function.
        """
        self._fields.append(field)
        return lambda: self._fields.remove(field)

    def add_observer(self, observer: GradObserver) -> None:
        """Attach a :class:`GradObserver` (e.g. numerics stats for the metrics exporter)."""
        self._observers.append(observer)

    def remove_observer(self, observer: GradObserver) -> None:
        """Detach an observer added with :meth:`add_observer`."""
        self._observers.remove(observer)

    # ----------------------------------------------------------------- inspection
    def counters(self) -> dict[str, torch.Tensor]:
        """The live device tensors (no sync): scale, trackers and event counters.

        Keys: scale, growth_tracker, hysteresis_tracker, steps, skipped_steps, skipped_in_a_row,
        growths, backoffs. Brought up to date from the host copy first (kernel launches only), so
        call it from the training thread. Before the first scale() the scaler has no device yet:
        the values come as new CPU tensors, and the scaler stays unplaced.
        """
        if not self._book.placed:
            host = self._book.read()
            return {k: torch.tensor(v) for k, v in _snapshot_dict(host).items()}
        tensors = self._book.tensors()
        counts = None if self._spike is None else self._spike.counts
        if counts is not None:  # the spike gate's, once it has decided a step
            tensors["spike_skipped_steps"] = counts[_spike_gate.SKIPPED]
            tensors["spike_skipped_in_a_row"] = counts[_spike_gate.IN_A_ROW]
        return tensors

    def snapshot(self, *, wait: bool = True) -> dict[str, float | int]:
        """:meth:`counters` as Python numbers.

        Free after plain steps (the host holds the state); after fused or ``sync_free`` steps it
        waits for the GPU. ``wait=False`` never waits and never writes, so another thread (a
        metrics scrape) may call it: after device-side updates it returns the newest state whose
        copy has reached the host, which may be an update or two behind.
        """
        values = _snapshot_dict(self._book.read() if wait else self._book.latest())
        predictive = self._predictive
        if predictive is not None:  # grad_max_abs, target_scale, margin_log2, underflow
            values.update(predictive.snapshot(self._telemetry(predictive, wait=wait)))
        if self._spike is not None:  # spike_skipped_steps, _in_a_row, _window_values, values
            values.update(self._spike.snapshot(wait=wait))
        return values

    def _telemetry(
        self, predictive: _predictive_state.PredictiveScaling, *, wait: bool = True
    ) -> _predictive.Telemetry:
        """policy="predictive"'s telemetry of the last update, from the device if it is there."""
        raw = self._book.words_now(predictive.pos["window"]) if wait else self._book.latest_words()
        if raw is None:
            return predictive.telemetry
        words, rows, policy, pos = raw
        return predictive.telemetry_from(words, rows, pos, policy)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled).

        Free after plain steps; after fused or ``sync_free`` steps this waits for the GPU.
        """
        if not self._enabled:
            return 1.0
        return self._book.read().scale

    def is_enabled(self) -> bool:
        """Whether this scaler scales (False: a transparent pass-through)."""
        return self._enabled

    def get_growth_factor(self) -> float:
        """The factor applied to the scale after growth_interval clean steps."""
        return self._policy.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (must be > 1)."""
        self._replace_policy(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The factor applied to the scale after an overflow."""
        return self._policy.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the back-off factor (must be in (0, 1))."""
        self._replace_policy(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The number of clean steps before the scale grows."""
        return self._policy.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an int >= 1)."""
        self._replace_policy(growth_interval=new_interval)

    def _replace_policy(self, **changes: Any) -> None:
        candidate = dataclasses.replace(self._policy, **changes)
        _state.check_scale_args(init_scale=1.0, **_policy_args(candidate))
        self._policy = candidate

    # ----------------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, Any]:
        """The scaler state: torch's five keys plus dscale's trackers (see ``dscale._state``).

        Empty when disabled. Call it after update(). Waits for the GPU only after fused or
        sync-free steps (otherwise the host holds the state).
        """
        if not self._enabled:
            return {}
        state = _state.to_state_dict(self._policy, self._book.read())
        if self._predictive is not None:  # version 2 and the keys of dscale/_predictive_state.py
            state.update(self._predictive.state_dict())
        if not self._loss_scaling:
            state["loss_scaling"] = False
        if self._spike is not None:
            state.update(self._spike.state_dict())
        if self._spike is not None or not self._loss_scaling:  # version 3: these keys
            state["dscale_format_version"] = max(
                state["dscale_format_version"], _state.GUARD_FORMAT_VERSION
            )
        return state

    def _checked_state(self, state_dict: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
        """What load_state_dict would apply, or ValueError; changes nothing.

        dscale.checkpoint calls it too, so that both ways in make the same checks.
        """
        policy, host = _state.from_state_dict(state_dict, self._policy)
        predictive = _predictive_state.from_state_dict(state_dict)
        spike = None if self._spike is None else self._spike.check_state(state_dict)
        if not self._loss_scaling:  # a StepGuard keeps its scale of 1; the counts come along
            policy = self._policy
            if _state.scales_loss(state_dict):  # a GradScaler's trackers mean nothing here
                host = _policy.HostState(1.0, 0, policy.hysteresis, host.counters)
        elif not _state.scales_loss(state_dict):
            raise ValueError(
                "this state dict was saved by a StepGuard (loss_scaling=False: its scale is "
                "fixed at 1), so it holds no loss scale for this GradScaler; start the "
                "GradScaler fresh, or load the dict into a StepGuard"
            )
        return policy, host, predictive, spike

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from dscale's or torch's GradScaler; no-op when disabled.

        The dict is validated completely first: a rejected one (ValueError) changes nothing.
        Keys that torch's dict lacks keep this scaler's settings; its trackers start fresh.
        """
        if not self._enabled:
            return
        policy, host, predictive, spike = self._checked_state(state_dict)
        self._policy = policy
        self._book.load(host)
        if self._spike is not None:
            self._spike.load(spike)
        if self._predictive is not None:
            self._predictive.load(predictive)
            self._predictive.note_interval(policy.growth_interval)
        else:
            _predictive_state.note_ignored(state_dict)

    # ----------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled and self._per_optimizer_states:
            raise RuntimeError(
                "A GradScaler instance may only be pickled at the beginning of an iteration, "
                "or at the end after scaler.update()."
            )
        # A process group is not picklable: keep its ranks and look it up again when used.
        state["_group_arg"] = None
        # Callbacks and observers belong to the running job, not to the scaler's state.
        state["_callbacks"] = []
        state["_observers"] = []
        state["_outcomes"] = {}
        state["_last_stepped"] = None
        state["_scale_range"] = None
        state["_inv_scale"] = None  # device tensors, made again on demand
        state["_one"] = None
        state["_scale_for_step"] = None
        state["_stepping"] = None
        # Hooks are registered on live models; a copy must attach() again.
        state["_hooks"] = ReductionHooks()
        if self._enabled and self._predictive is not None:  # the last update's (rings are kept)
            state["_predictive_telemetry"] = self._telemetry(self._predictive)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        defaults = (
            ("_read_host_flags", True),
            ("_inv_scale", None),
            ("_one", None),
            ("_scale_for_step", None),
            ("_iteration", 0),
            ("_placed_init_scale", 2.0**16),
            ("_loss_scaling", True),
            ("_spike", None),
            ("_spike_warned_at", 0),
        )
        for name, default in defaults:
            state.setdefault(name, default)  # pickled before these existed
        telemetry = state.pop("_predictive_telemetry", None)
        self.__dict__.update(state)
        predictive = getattr(self, "_predictive", None)
        if predictive is not None and telemetry is not None:
            predictive.telemetry = telemetry
        if predictive is not None:  # its device words, sized by this version's layout
            lengths = predictive.lengths
            self._book.tail_words = _predictive_state.tail_words(
                lengths["window"], lengths["memory"]
            )


GradScaler._optimizer_state_type = _OptimizerState


def _local_flags(optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
    """``{device: 1.0 if some grad of optimizer's on this rank is inf/NaN else 0.0}``, read only."""
    flags: dict[torch.device, torch.Tensor] = {}
    for device, per_dtype in group_by_device_and_dtype(optimizer_grads(optimizer)).items():
        norms = [
            n for tensors in per_dtype.values() for n in torch._foreach_norm(tensors, math.inf)
        ]
        flags[device] = (~torch.stack(norms).isfinite()).any().float()
    return flags


def _is_power_of_two(host: _policy.HostState | None) -> bool:
    return host is not None and math.frexp(host.scale)[0] == 0.5


# step function -> whether it takes grad_scaler=: inspect.signature costs ~30 us, more than the
# rest of a fused step's own work, so it is read once per plain function (weakly: a class can go).
# Functions hash by identity and their signature is fixed; any other callable (an object whose
# class's __call__ may be patched, or that hashes by value) is read afresh every time.
_TAKES_GRAD_SCALER: weakref.WeakKeyDictionary[types.FunctionType, bool] = (
    weakref.WeakKeyDictionary()
)


def _takes_grad_scaler(optimizer: torch.optim.Optimizer) -> bool:
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


def _is_torch_fused(optimizer: torch.optim.Optimizer) -> bool:
    """One of torch.optim's own fused implementations (whose kernels dscale's tests cover)."""
    module = type(optimizer).__module__
    return module.startswith("torch.optim.") and bool(optimizer.defaults.get("fused"))


def _policy_args(policy: _policy.ScalePolicy) -> dict[str, Any]:
    return dataclasses.asdict(policy)


def _checked_new_scale(new_scale: float | torch.Tensor) -> float | torch.Tensor:
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad:
            raise ValueError(
                "new_scale must be a float or a one-element tensor with requires_grad=False, "
                f"got a tensor of shape {tuple(new_scale.shape)}"
            )
        return new_scale
    if (
        isinstance(new_scale, bool)
        or not isinstance(new_scale, (int, float))
        or not (math.isfinite(new_scale) and new_scale > 0)
    ):
        raise ValueError(f"new_scale must be a finite number > 0, got {new_scale!r}")
    return float(new_scale)


def _snapshot_dict(state: _policy.HostState) -> dict[str, float | int]:
    return {
        "scale": state.scale,
        "growth_tracker": state.growth_tracker,
        "hysteresis_tracker": state.hysteresis_tracker,
        **dict(zip(COUNTER_NAMES, state.counters, strict=True)),
    }
