"""The check: one optimizer's grads to this rank's agreement vector, on its way to the peers.

:func:`check` runs the stages in order (``docs/CONTRACTS.md`` draws them):

1. **collect**: the hooks' report (``attach()``: what the reduction already unscaled and
   checked) and the grads left for this rank's own pass;
2. **observe**: observers see the still-scaled grads (``dscale.stats``);
3. **measure**: ``policy="predictive"``'s largest magnitude, before the unscale;
4. **check**: the fused inf/NaN check, unscaling where the step wants unscaled grads;
5. **signals**: flags from elsewhere (the hooks', a user's), the registered fields and the
   spike gate's values join the vector (its :class:`~dscale.scaler._program.agreement.Layout`);
6. **agree**: the one MAX all-reduce starts (``unscale_()`` defers it to the flag's first read:
   ``_decision.start_deferred``).

Under ``attach()`` the grads the hooks unscaled and checked are checked again here (inf/NaN only,
times 1): a write since the reduction that no version shows (``p.grad.data``, ``.numpy()``) may
have put an inf into them, on one rank only, so the agreement collective runs under attach() too,
DDP's global flag included. A refusal of ``attach()`` (grads its hooks did not check) joins the
peers' collective with an overflowed vector of the same layout before it is raised, so that no
rank waits alone.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dscale import _dist
from dscale.scaler._attach.hooks import AttachRefusal, HookReport
from dscale.scaler._program import agreement as _agreement
from dscale.scaler._program import placements as _placements
from dscale.scaler._program import predictive as _predictive
from dscale.scaler._program import unscale as _unscale
from dscale.scaler._program.agreement import Layout
from dscale.scaler._program.grad_measure import mark_overflow
from dscale.scaler._program.unscale import (
    GradGroups,
    check_and_unscale_,
    copy_to,
    group_by_device_and_dtype,
    local_tensor,
    optimizer_grads,
)
from dscale.scaler._stage import OptimizerState, Stage

if TYPE_CHECKING:
    from dscale.scaler._attach.hooks import ReductionHooks
    from dscale.scaler._program.spike_gate import SpikeGate
    from dscale.scaler._state.book import ScaleState
    from dscale.scaler._state.predictive import PredictiveScaling


class _GradsObserver(Protocol):
    def on_grads(
        self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], scale: torch.Tensor
    ) -> None: ...


class Scaler(Protocol):
    """What the check reads of the scaler (``GradScaler`` is one; nothing here imports it)."""

    @property
    def _book(self) -> ScaleState: ...
    @property
    def _factors(self) -> _unscale.UnscaleFactors: ...
    @property
    def _fields(self) -> Sequence[_agreement.AgreementField]: ...
    @property
    def _hooks(self) -> ReductionHooks: ...
    @property
    def _loss_scaling(self) -> bool: ...
    @property
    def _observers(self) -> Sequence[_GradsObserver]: ...
    @property
    def _observing(self) -> bool: ...
    @property
    def _per_optimizer_states(self) -> dict[int, Any]: ...
    @property
    def _predictive(self) -> PredictiveScaling | None: ...
    @property
    def _spike(self) -> SpikeGate | None: ...
    def _carries_range(self) -> bool: ...
    def _decides_on_host(self, agreed: torch.Tensor) -> bool: ...
    def _process_group(self) -> Any | None: ...
    def _require_scale(self, funcname: str) -> torch.Tensor: ...


_LOCAL_SHARD = operator.attrgetter("_local_tensor")  # a DTensor's rank-local shard

# Grads that a fused optimizer's check may unscale in place without losing small values.
_FULL_PRECISION = (torch.float32, torch.float64)


def check(
    scaler: Scaler,
    optimizer: torch.optim.Optimizer,
    state: OptimizerState,
    *,
    unscale: bool | None,
    unscaled_by_caller: bool = False,
    defer: bool = False,
) -> bool:
    """Run the stages for ``optimizer``; True when its grads are unscaled afterwards.

    ``unscale``: whether this rank's pass unscales (None: a fused optimizer's, chosen by
    :func:`_unscales_for_fused`). ``unscaled_by_caller``: code written for torch's scaler
    unscaled the grads itself. ``defer``: start the agreement at the flag's first read.
    """
    scale = scaler._require_scale("unscale_")
    group = scaler._process_group()
    state.lone = group is None
    _refuse_a_second_gated_optimizer(scaler)
    # 1. collect
    try:
        report = _hooks_report(scaler, optimizer, state, group, scale, unscaled_by_caller)
    except AttachRefusal as exc:
        if _join_peers_refusing(scaler, optimizer, state, exc, group, scale, defer):
            # unscale_(): the refusal is raised at the flag's first read, once this rank has
            # joined the peers' agreement; until then unscale_() returns as if it had checked.
            return True
        raise
    state.backwards = report.backwards
    placed = _placements.sum_partial_grads(optimizer)  # a Partial piece is not the grad
    # Nothing left for this rank's pass where the hooks checked every grad.
    grads = [] if report.complete else optimizer_grads(optimizer, set(report.covered))
    groups = group_by_device_and_dtype(grads)
    rechecked = group_by_device_and_dtype(_covered_grads(optimizer, report))
    if unscale is None:
        unscale = _unscales_for_fused(scaler, scale, groups)
    unscale = unscale or report.unscaled  # the pass must match what the hooks did
    if not scaler._loss_scaling:
        unscale = True  # the scale is 1: checked grads are unscaled grads
    # 2. observe (inside scaler.observing() the observers had the grads already)
    if not scaler._observing:
        for observer in scaler._observers:
            observer.on_grads(optimizer, grads, scale)
    device = scale.device if group is None else _dist.flag_device(group, scale.device)
    host = None if torch.compiler.is_compiling() else scaler._book.host  # traced: no numbers
    layout = _leading_layout(scaler)
    with _unscale.NoGrad():
        vector = layout.blank(scale, None if host is None else host.scale, device)
        state.agreed, state.layout = vector, layout  # the flag so far, should a stage raise
        # 3. measure (on the CPU the largest magnitude also says inf/NaN: `checked`)
        checked = None
        if scaler._predictive is not None:
            at = layout.start("measured")
            checked = scaler._predictive.measure.write(
                vector, at, groups, report.measured, scale=scale
            )
        # 4. check (the kernel writes the flag into its slot: a view)
        flag = vector[_agreement.OVERFLOW]
        if groups:  # none left when attach()'s hooks checked every grad: no 1/scale either
            factors = scaler._factors
            inv_scale = factors.inverse(scale, host) if unscale else factors.one(scale)
            check_and_unscale_(groups, inv_scale, flag, None if unscale else checked)
        # 5. signals
        _fold_flags(scaler, vector, layout, flag, bool(groups), (report.flag, state.user_found))
        if rechecked:  # 4 for attach(): the hooked grads again, times 1 (unscaled already)
            check_and_unscale_(rechecked, scaler._factors.one(scale), flag)  # sets, never clears
            if scaler._predictive is not None:  # an inf found here reads as an overflow
                mark_overflow(vector, layout.start("measured"), flag)
        fields = _field_values(scaler, optimizer)  # before the gate's, in the vector's order
        carried = None if unscale else scale  # every grad this rank holds, hooked ones too
        spike = _spike_values(scaler, optimizer, report, grads, carried, device, group, placed)
        vector, layout = layout.append(vector, fields, spike)
    state.agreed, state.layout = vector, layout
    # 6. agree
    state.over_group = group is not None
    if defer:
        state.deferred, state.deferred_group = True, group
    else:
        state.work = None if group is None else _agreement.all_reduce_flag(vector, group)
    return unscale


def _refuse_a_second_gated_optimizer(scaler: Scaler) -> None:
    """The spike gate decides once per iteration: a second optimizer in it is an error."""
    if scaler._spike is not None and len(scaler._per_optimizer_states) > 1:
        raise RuntimeError(
            "the spike gate decides once per iteration on the loss and the grad norm, but a "
            "second optimizer was checked in this iteration; with several optimizers use "
            "one GradScaler per optimizer, or turn the spike gate off (spike_signals=())"
        )


def _hooks_report(
    scaler: Scaler,
    optimizer: torch.optim.Optimizer,
    state: OptimizerState,
    group: Any,
    scale: torch.Tensor,
    unscaled_by_caller: bool,
) -> HookReport:
    """What attach()'s hooks did for ``optimizer``; AttachRefusal for grads they missed."""
    report = scaler._hooks.report(optimizer, group, scale.device)
    if unscaled_by_caller and report.covered:
        # torch's in-place unscale kernel leaves the grads' versions as they were, so the
        # hooks cannot see this write: the stage says it.
        twice = AttachRefusal(
            f"attach(): the grads of {len(report.covered)} parameter(s) were unscaled in "
            "the attached model's reduction, and code written for torch's scaler marked "
            "them unscaled itself (['stage'] = OptState.UNSCALED): it divided them a "
            "second time. Let the scaler unscale them (scaler.unscale_(optimizer)), or do "
            "not attach() this model"
        )
        state.stage = Stage.READY  # the next iteration's code says it again, or not
        raise twice
    return report


def _leading_layout(scaler: Scaler) -> Layout:
    """This iteration's leading fields, for the check and a refusal alike (the peers' length)."""
    with_range, measured = scaler._carries_range(), scaler._predictive is not None
    if torch.compiler.is_compiling():  # made at trace time (dynamo skips lru_cache, warning)
        return Layout(with_range=with_range, measured=measured)
    return Layout.leading(with_range, measured)


def _covered_grads(optimizer: torch.optim.Optimizer, report: HookReport) -> list[torch.Tensor]:
    """The rank-local grads attach()'s hooks unscaled and checked, for the check again at step.

    They are unscaled, as after ``unscale_()``, and the hooks' flag covers them as the reduction
    left them; a write since then through an alias whose version does not move (``.data``,
    ``.numpy()``, a kernel that writes in place without a version bump) is invisible to
    :meth:`ReductionHooks.report`, so what the step will consume is checked for inf/NaN here.
    """
    if not report.covered:
        return []
    covered = None if report.complete else report.covered
    grads = [
        grad
        for group in optimizer.param_groups
        for param in group["params"]
        if (grad := param.grad) is not None and (covered is None or id(param) in covered)
    ]
    dtensor = _unscale.DTensor
    if dtensor is not None and any(map(isinstance, grads, repeat(dtensor))):
        if all(map(isinstance, grads, repeat(dtensor))):  # FSDP2: C callables, no Python per grad
            return list(map(_LOCAL_SHARD, grads))
        return list(map(local_tensor, grads))
    return grads


def _unscales_for_fused(scaler: Scaler, scale: torch.Tensor, groups: GradGroups) -> bool:
    """Whether the check unscales for a fused optimizer (else its kernel does, as torch's).

    Where the host decides (the CPU), the check writes every grad anyway, so unscaling there is
    free and spares the fused kernel its own division (an extra pass on the CPU). On a GPU the
    kernel's division costs nothing, while 1/scale would cost three launches. fp16/bf16 grads
    stay scaled: unscaled in their own storage, small values would flush to zero. Only at a
    power-of-two scale is a product with f32(1/scale) the kernel's division exactly.
    """
    host = scaler._book.host
    return (
        scaler._decides_on_host(scale)
        and host is not None
        and math.frexp(host.scale)[0] == 0.5
        and all(d in _FULL_PRECISION for per_dtype in groups.values() for d in per_dtype)
    )


def _fold_flags(
    scaler: Scaler,
    vector: torch.Tensor,
    layout: Layout,
    flag: torch.Tensor,
    written: bool,
    others: tuple[torch.Tensor | None, ...],
) -> None:
    """Fold the hooks' and a user's flags into this rank's (``written``: the check wrote it).

    MAX of flags as 0 or 1, not +: torch's fused kernels skip only where found_inf == 1 exactly,
    and a user's flag may say 2 (or -1, which torch's update reads as found).
    """
    device = flag.device
    for other in others:
        if other is None:
            continue
        other = copy_to(other, device).reshape(())
        if written:
            torch.maximum(flag, (other > 0).float(), out=flag)
        else:  # flag is 0: (other > 0) in one op (heaviside at 0 takes flag's 0)
            torch.heaviside(other.float(), flag, out=flag)
            written = True
        if scaler._predictive is not None:
            mark_overflow(vector, layout.start("measured"), other)


def _field_values(
    scaler: Scaler, optimizer: torch.optim.Optimizer
) -> list[tuple[_agreement.AgreementField, torch.Tensor]]:
    """The registered fields' values for this step (those that send any)."""
    sent = []
    for field in scaler._fields:
        values = field.values(optimizer)
        if values is not None:
            sent.append((field, values))
    return sent


def _spike_values(
    scaler: Scaler,
    optimizer: torch.optim.Optimizer,
    report: HookReport,
    grads: list[torch.Tensor],
    carried: torch.Tensor | None,
    device: torch.device,
    group: Any,
    placed: _placements.ParamSet | None,
) -> torch.Tensor | None:
    """The spike gate's slots: this rank's loss and grad norm in its own, -inf in the peers'.

    None when the gate is off. The norm is over every grad this rank holds for the step:
    ``grads`` (this rank's pass) and those attach()'s hooks checked (``report``), carrying
    ``carried`` (the scale while still scaled; None: unscaled); ``placed`` their placements on
    the mesh, whose weights make the norm global (:mod:`~dscale.scaler._program.placements`;
    None: plain tensors).
    """
    if scaler._spike is None:
        return None
    if report.covered:
        grads = optimizer_grads(optimizer)
    roots = None if placed is None else placed.roots_on(device)  # a copy counts once
    return scaler._spike.tail(
        grads, carried, device, _dist.rank(group), _dist.world_size(group), roots
    )


def join_peers_without_a_scale(
    scaler: Scaler,
    optimizer: torch.optim.Optimizer,
    state: OptimizerState,
    exc: Exception,
    defer: bool,
) -> bool:
    """A rank with no scale placed at step()/unscale_(): join the peers' agreement refusing.

    Its peers may be waiting in the agreement (a pipeline stage built without pipeline_loss()
    while the others were): joined with a refusal, they skip instead of waiting until the
    process group's timeout. The scale sent is the initial one, made here, not placed (the
    next iteration refuses again). True when the joining is left to step() (``defer``).
    """
    group = scaler._process_group()
    if group is None or _dist.world_size(group) < 2:
        return False
    device = next(
        (p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu")
    )
    host = scaler._book.host
    value = float(host.scale) if host is not None else 1.0
    scale = torch.full((), value, dtype=torch.float32, device=device)
    return _join_peers_refusing(scaler, optimizer, state, exc, group, scale, defer)


def _join_peers_refusing(
    scaler: Scaler,
    optimizer: torch.optim.Optimizer,
    state: OptimizerState,
    exc: Exception,
    group: Any,
    scale: torch.Tensor,
    defer: bool,
) -> bool:
    """Join the agreement the peers run with an overflowed vector.

    Returns True when the joining is left to the flag's first read (``defer``: unscale_()), so
    that the caller returns instead of raising now; False when it ran here, or no peer waits.

    Under attach() the peers always run it (their step checks the hooks' grads again): joined
    with a refusal, they skip rather than wait.
    """
    if group is None:
        return False
    device = _dist.flag_device(group, scale.device)
    layout = _leading_layout(scaler)
    blank = None
    if scaler._spike is not None:  # as long as the peers' (our slots: -inf)
        width = len(scaler._spike.signals) * _dist.world_size(group)
        blank = torch.full((width,), -math.inf, device=device)
    refusal, state.layout = layout.append(
        layout.refusal(scale, device, _predictive.OVERFLOW_MARK),
        _field_values(scaler, optimizer),
        blank,
    )
    if defer:
        # unscale_(): the peers agree at the flag's first read, after any collective of the
        # user's in between (FSDP's clip_grad_norm_): join there, then raise.
        state.agreed, state.refused = refusal, exc
        state.deferred, state.deferred_group = True, group
        return True
    work = _agreement.all_reduce_flag(refusal, group)
    if work is not None:  # None: synchronous under torch.compile
        work.wait()
    # This rank now holds what its peers agreed on (a skip): update() backs off as theirs does,
    # and a second step() raises instead of waiting alone in a collective.
    state.agreed, state.over_group, state.stage = refusal, True, Stage.STEPPED
    return False
