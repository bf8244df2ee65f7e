"""The agreed vector, read: the flag a step obeys, and the decision on the host when it is read.

The collective the check started completes here: :func:`agreed` waits for it, and starts first
the one ``unscale_()`` left for the flag's first read (:func:`start_deferred`), which a flag
written since then joins, or which a backward since then turns into a refusal.

After :mod:`dscale.scaler._check` started the collective, a step needs the agreed vector: on the
device (fused and ``sync_free`` steps skip on the flag itself, no host sync) or on the host (a plain
step's one sync, which brings the whole small vector: the measurement, the scale range and the
spike decision come with it). update() reads the iteration's flag and scale range here too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from dscale import _dist
from dscale.scaler._program import agreement as _agreement
from dscale.scaler._program.grad_measure import mark_overflow
from dscale.scaler._program.unscale import NoGrad, copy_to
from dscale.scaler._stage import OptimizerState

if TYPE_CHECKING:
    from dscale.scaler._attach.hooks import ReductionHooks
    from dscale.scaler._program.spike_gate import SpikeGate
    from dscale.scaler._state.predictive import PredictiveScaling


class Scaler(Protocol):
    """What the decision reads of the scaler (``GradScaler`` is one; nothing here imports it)."""

    @property
    def _sync_free(self) -> bool: ...
    @property
    def _spike(self) -> SpikeGate | None: ...
    @property
    def _predictive(self) -> PredictiveScaling | None: ...
    @property
    def _hooks(self) -> ReductionHooks: ...
    def _decides_on_host(self, agreed: torch.Tensor) -> bool: ...
    def _require_scale(self, funcname: str) -> torch.Tensor: ...
    def _process_group(self) -> Any | None: ...


#: :meth:`GradScaler.agreed_scale_range` of an iteration with no group: the scale itself.
OWN_SCALE = "own scale"


class StepDecision(NamedTuple):
    """What a step obeys.

    ``flag``: the skip flag (0-d, > 0: skip) for a device-side step, else None. ``outcome``:
    whether the step is applied, a bool known on the host or the flag to read on request.
    """

    flag: torch.Tensor | None
    outcome: bool | torch.Tensor


def for_step(scaler: Scaler, state: OptimizerState, *, fused: bool) -> StepDecision:
    """The decision ``optimizer``'s step obeys, waiting for the agreement.

    A fused kernel always gets the flag; ``sync_free`` steps get it where the host cannot read
    it for free (a GPU); everything else is decided on the host. Where the vector is in host
    memory (the CPU) the outcome is read there at no cost, fused steps included.
    """
    vector = agreed(scaler, state)
    on_host = scaler._decides_on_host(vector)
    if fused:
        flag = skip_flag(scaler, state)
        return StepDecision(flag, decide_on_host(scaler, state) if on_host else flag)
    if scaler._sync_free and not on_host:
        flag = skip_flag(scaler, state)
        return StepDecision(flag, flag)
    return StepDecision(None, decide_on_host(scaler, state))


def agreed(scaler: Scaler, state: OptimizerState) -> torch.Tensor:
    """The agreed vector of ``state`` on the scale's device (waits for the collective)."""
    if state.deferred:
        start_deferred(scaler, state)
    if state.work is not None:
        state.work.wait()
        state.work = None
    if state.layout is not None and not torch.compiler.is_compiling():
        # Also without a collective (one process): the fields' own checks still hold.
        _agreement.verify_fields(state.layout)
    assert state.agreed is not None  # noqa: S101 - set by the check
    scale = scaler._require_scale("step")
    if state.agreed.device != scale.device:
        state.agreed = copy_to(state.agreed, scale.device)
    return state.agreed


def overflow_flag(scaler: Scaler, state: OptimizerState) -> torch.Tensor:
    """The agreed overflow flag (0-d; > 0: some rank's grads held an inf or NaN)."""
    return agreed(scaler, state)[_agreement.OVERFLOW]


def skip_flag(scaler: Scaler, state: OptimizerState) -> torch.Tensor:
    """The flag the step obeys (> 0: skip): the overflow flag, or with the spike gate on the
    larger of it and the gate's decision (0 or 1 either way: fused kernels test == 1).

    With the gate, the first call decides (its window statistics) and writes the skip flag into
    the last spike slot of the agreed vector; later calls return the same flag.
    """
    vector = agreed(scaler, state)
    flag = vector[_agreement.OVERFLOW]
    if scaler._spike is None:
        return flag
    if state.skip is None:
        assert state.layout is not None  # noqa: S101 - set by the check
        tail = state.layout.view(vector, _agreement.SPIKE)
        state.spike, state.spike_values, state.skip = scaler._spike.decide(tail, flag)
    return state.skip


def decide_on_host(scaler: Scaler, state: OptimizerState) -> bool:
    """Read the agreed vector on the host (one sync on GPU): whether the step is applied.

    The whole (small) vector comes in that one copy: policy="predictive" uses its
    measurement, and the scale range is then known on the host too (and the spike gate's skip
    flag, which its decide() writes into the last of its slots).
    """
    vector = agreed(scaler, state)
    if scaler._spike is not None:
        # The gate decides first: it writes the step's skip flag into its last slot of
        # ``vector``, so that the one read below brings the decision with the rest.
        skip_flag(scaler, state)
    state.host_agreed = values = vector.tolist()
    state.overflowed = values[_agreement.OVERFLOW] > 0
    if scaler._spike is not None:
        assert state.layout is not None  # noqa: S101 - set by the check
        state.applied = not values[state.layout.slots[_agreement.SPIKE].stop - 1] > 0
    else:
        state.applied = not state.overflowed
    return state.applied


def iteration_flag(scaler: Scaler, states: list[OptimizerState]) -> torch.Tensor:
    """The iteration's agreed flag on the scale's device (> 0: some step overflowed)."""
    flags = [overflow_flag(scaler, s) for s in states]
    return flags[0] if len(flags) == 1 else torch.stack(flags).amax()  # stays 0 or 1


def scale_range_source(scaler: Scaler, states: list[OptimizerState]) -> torch.Tensor | str | None:
    """What the scale range over the group is read from after this iteration.

    After a collective: its agreed vector (turned into the range only when asked for), or None
    if it carried the flag alone; :data:`OWN_SCALE` for one process; None where no scaler
    collective ran.
    """
    for state in states:
        if state.over_group:
            layout = state.layout
            return agreed(scaler, state) if layout is not None and layout.with_range else None
    if all(state.lone for state in states):
        return OWN_SCALE
    return None


def end_spike_iteration(scaler: Scaler, states: list[OptimizerState]) -> torch.Tensor | None:
    """The spike gate's end of an iteration: the window and counters; the skip flag."""
    gate = scaler._spike
    if gate is None:
        return None
    skip = None
    for state in states:
        if state.spike is not None and state.spike_values is not None:
            assert state.skip is not None  # noqa: S101 - decided with the spike
            gate.push(state.spike_values, state.spike, state.skip)
            skip = state.skip
    gate.end_iteration()
    return skip


def start_deferred(scaler: Scaler, state: OptimizerState) -> None:
    """Start the agreement unscale_() left for later, with a flag written since then.

    The written flag joins this rank's as torch's would (MAX: it adds a found overflow, it
    cannot hide one). The agreement runs under attach() too (the check takes the hooked grads
    again), so a flag written on some ranks only is agreed on like any other.
    Registered fields that follow the grads refresh their slots first (clipping since then).
    """
    state.deferred = False
    group, state.deferred_group = state.deferred_group, None
    late, state.late_found = state.late_found, None
    assert state.agreed is not None and state.layout is not None  # noqa: S101 - the check's
    if state.refused is not None:  # the refusal vector: join the peers' agreement, raise
        refused, state.refused = state.refused, None
        work = _agreement.all_reduce_flag(state.agreed, group)
        if work is not None:  # None: synchronous under torch.compile
            work.wait()
        raise refused
    if late is not None:
        with NoGrad():
            flag = state.agreed[_agreement.OVERFLOW]
            late = copy_to(late, flag.device).reshape(())
            torch.maximum(flag, (late > 0).float(), out=flag)
            if scaler._predictive is not None:
                mark_overflow(state.agreed, state.layout.start("measured"), late)
        if group is None:
            group = scaler._process_group()
            if group is not None:
                scale = scaler._require_scale("step")
                state.agreed = copy_to(state.agreed, _dist.flag_device(group, scale.device))
                state.layout.hand_over(state.agreed)  # the fields read the copy that travels
    with NoGrad():  # fields whose values follow the grads send them as they are now
        state.layout.refresh(state.agreed)
    if group is not None:
        state.over_group = True
        state.work = _agreement.all_reduce_flag(state.agreed, group)


def refuse_a_backward_since_unscale(
    scaler: Scaler, optimizer: torch.optim.Optimizer, state: OptimizerState
) -> None:
    """attach(): raise if a backward changed ``optimizer``'s grads after unscale_() checked."""
    if not state.backwards or scaler._hooks.backwards(optimizer) == state.backwards:
        return
    # A backward through DDP or FSDP2 is collective, so every rank refuses here alike. One
    # outside the reduction (no_sync(), the bare module) may run on one rank only: the
    # agreement unscale_() left pending then goes out marked overflowed, so that the
    # peers skip rather than wait in it. Nothing is applied here either way. (With one
    # process no collective runs: the flag is left as it is.)
    mine = state.agreed
    if state.deferred and (state.deferred_group is not None or state.late_found is not None):
        assert mine is not None and state.layout is not None  # noqa: S101 - the check's
        with NoGrad():
            mine[_agreement.OVERFLOW].fill_(1.0)
            if scaler._predictive is not None:
                at = state.layout.start("measured")
                mark_overflow(mine, at, torch.ones((), device=mine.device))
        start_deferred(scaler, state)
    raise RuntimeError(
        "attach(): a backward pass ran through the attached model (or, outside its "
        "reduction, through its parameters) after scaler.unscale_(optimizer) and before "
        "scaler.step(optimizer); the flag that "
        "unscale_() agreed on does not cover the grads it added, so the step is refused. "
        "Call scaler.unscale_(optimizer) after the last backward before the step"
    )
