"""A GradScaler's state beyond the step: its readings, its state dict and its pickled form.

``format.py`` owns the format of the scale and trackers; here the features' parts join
it (predictive's rings, the spike gate's window, a StepGuard's fixed scale), are checked as one
before anything is applied, and a pickled copy leaves behind what belongs to the running job.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dscale.scaler._attach.hooks import ReductionHooks
from dscale.scaler._program import predictive as _predictive
from dscale.scaler._program import scale_rule as _policy
from dscale.scaler._program import spike_gate as _spike_gate
from dscale.scaler._program import unscale as _unscale
from dscale.scaler._state import format as _state
from dscale.scaler._state import predictive as _predictive_state

if TYPE_CHECKING:
    from dscale.scaler._state.book import ScaleState


class Scaler(Protocol):
    """What the readings, the state dict and pickling read of the scaler (``GradScaler`` is one;
    nothing here imports it). Loading a state dict writes ``scale_rule``; unpickling its
    ``__dict__``."""

    _policy: _policy.ScalePolicy

    @property
    def _book(self) -> ScaleState: ...
    @property
    def _enabled(self) -> bool: ...
    @property
    def _loss_scaling(self) -> bool: ...
    @property
    def _per_optimizer_states(self) -> dict[int, Any]: ...
    @property
    def _predictive(self) -> _predictive_state.PredictiveScaling | None: ...
    @property
    def _spike(self) -> _spike_gate.SpikeGate | None: ...


def counters(scaler: Scaler) -> dict[str, torch.Tensor]:
    """``GradScaler.counters()``: the live tensors, or new CPU ones before the first scale()."""
    if not scaler._book.placed:
        return {k: torch.tensor(v) for k, v in _numbers(scaler._book.read()).items()}
    tensors = scaler._book.tensors()
    counts = None if scaler._spike is None else scaler._spike.counts
    if counts is not None:  # the spike gate's, once it has decided a step
        tensors["spike_skipped_steps"] = counts[_spike_gate.SKIPPED]
        tensors["spike_skipped_in_a_row"] = counts[_spike_gate.IN_A_ROW]
    return tensors


def snapshot(scaler: Scaler, *, wait: bool = True) -> dict[str, float | int]:
    """``GradScaler.snapshot()``: the counters as numbers, with the features' readings."""
    book = scaler._book
    values = _numbers(book.read() if wait else book.latest())
    predictive = scaler._predictive
    if predictive is not None:  # grad_max_abs, target_scale, margin_log2, underflow
        values.update(predictive.snapshot(telemetry(scaler, predictive, wait=wait)))
    if scaler._spike is not None:  # spike_skipped_steps, _in_a_row, _window_values, values
        values.update(scaler._spike.snapshot(wait=wait))
    return values


def telemetry(
    scaler: Scaler, predictive: _predictive_state.PredictiveScaling, *, wait: bool = True
) -> _predictive.Telemetry:
    """policy="predictive"'s telemetry of the last update, from the device if it is there."""
    book = scaler._book
    raw = book.words_now(predictive.pos["window"]) if wait else book.latest_words()
    if raw is None:
        return predictive.telemetry
    words, rows, policy, pos = raw
    return predictive.telemetry_from(words, rows, pos, policy)


def _numbers(state: _policy.HostState) -> dict[str, float | int]:
    return {
        "scale": state.scale,
        "growth_tracker": state.growth_tracker,
        "hysteresis_tracker": state.hysteresis_tracker,
        **dict(zip(_policy.COUNTER_NAMES, state.counters, strict=True)),
    }


def state_dict(scaler: Scaler) -> dict[str, Any]:
    """torch's five keys, dscale's trackers, then each feature's keys (``format`` says which)."""
    state = _state.to_state_dict(scaler._policy, scaler._book.read())
    if scaler._predictive is not None:  # version 2, and the keys of _state/predictive.py
        state.update(scaler._predictive.state_dict())
    if not scaler._loss_scaling:
        state["loss_scaling"] = False
    if scaler._spike is not None:
        state.update(scaler._spike.state_dict())
    if scaler._spike is not None or not scaler._loss_scaling:  # version 3: these keys
        state["dscale_format_version"] = max(
            state["dscale_format_version"], _state.GUARD_FORMAT_VERSION
        )
    return state


def checked(scaler: Scaler, state_dict: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
    """(policy, host state, predictive rings, spike window) that loading would apply, or
    ValueError; changes nothing."""
    policy, host = _state.from_state_dict(state_dict, scaler._policy)
    predictive = _predictive_state.from_state_dict(state_dict)
    spike = None if scaler._spike is None else scaler._spike.check_state(state_dict)
    if not scaler._loss_scaling:  # a StepGuard keeps its scale of 1; the counts come along
        policy = scaler._policy
        if _state.scales_loss(state_dict):  # a GradScaler's trackers mean nothing here
            host = _policy.HostState(1.0, 0, policy.hysteresis, host.counters)
    elif not _state.scales_loss(state_dict):
        raise ValueError(
            "this state dict was saved by a StepGuard (loss_scaling=False: its scale is "
            "fixed at 1), so it holds no loss scale for this GradScaler; start the "
            "GradScaler fresh, or load the dict into a StepGuard"
        )
    return policy, host, predictive, spike


def load(scaler: Scaler, state_dict: Mapping[str, Any]) -> None:
    """Check the whole dict, then apply it."""
    policy, host, predictive, spike = checked(scaler, state_dict)
    scaler._policy = policy
    scaler._book.load(host)
    if scaler._spike is not None:
        scaler._spike.load(spike)
    if scaler._predictive is not None:
        scaler._predictive.load(predictive)
        scaler._predictive.note_interval(policy.growth_interval)
    else:
        _predictive_state.note_ignored(state_dict)


def picklable(scaler: Scaler) -> dict[str, Any]:
    """``scaler.__dict__`` without what belongs to the running job (between iterations only)."""
    state = scaler.__dict__.copy()
    if scaler._enabled and scaler._per_optimizer_states:
        raise RuntimeError(
            "A GradScaler instance may only be pickled at the beginning of an iteration, "
            "or at the end after scaler.update()."
        )
    # A process group is not picklable: keep its ranks and look it up again when used.
    state["_group_arg"] = None
    # Callbacks and observers belong to the running job, not to the scaler's state.
    state["_callbacks"] = []
    state["_observers"] = []
    state["_observing"] = False
    state["_observed"] = None
    state["_outcomes"] = {}
    state["_last_stepped"] = None
    state["_scale_range"] = None
    state["_factors"] = _unscale.UnscaleFactors()  # device tensors, made again on demand
    state["_scale_for_step"] = None
    state["_stepping"] = None
    # Hooks are registered on live models; a copy must attach() again.
    state["_hooks"] = ReductionHooks()
    if scaler._enabled and scaler._predictive is not None:  # the last update's (rings are kept)
        state["_predictive_telemetry"] = telemetry(scaler, scaler._predictive)
    return state


# Attributes that scalers pickled by earlier versions lack, with the value they meant.
_ADDED_SINCE = (
    ("_read_host_flags", True),
    ("_scale_for_step", None),
    ("_iteration", 0),
    ("_watch_due", False),
    ("_placed_init_scale", 2.0**16),
    ("_loss_scaling", True),
    ("_spike", None),
    ("_spike_warned_at", 0),
    ("_pipeline", None),
    ("_loss_recorded", False),
)


def unpickle(scaler: Scaler, state: dict[str, Any]) -> None:
    """Restore a pickled scaler, from this version or an earlier one."""
    for name, default in _ADDED_SINCE:
        state.setdefault(name, default)
    state.setdefault("_factors", _unscale.UnscaleFactors())
    state.pop("_inv_scale", None)  # earlier versions' cache of 1/scale
    state.pop("_one", None)
    telemetry = state.pop("_predictive_telemetry", None)
    scaler.__dict__.update(state)
    predictive = getattr(scaler, "_predictive", None)
    if predictive is not None and telemetry is not None:
        predictive.telemetry = telemetry
    if predictive is not None:  # its device words, sized by this version's layout
        lengths = predictive.lengths
        scaler._book.tail_words = _predictive_state.tail_words(lengths["window"], lengths["memory"])
