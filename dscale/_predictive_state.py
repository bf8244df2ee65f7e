"""A predictive GradScaler's own state: where it lives, its state-dict keys, cross-policy loads.

Like the scale (``_scale_state``), the rule's state stays on the host while every decision is known
there (plain optimizer steps) and moves to a small device vector after fused or ``sync_free`` steps,
so no step waits for the GPU.

State-dict keys (format version 2; a dynamic scaler's dict stays version 1):
    policy: "predictive" (informational; the constructor's ``policy`` decides).
    predictive_margin_log2: the safety margin's exponent (int).
    _predictive_rise_tracker: clean steps in a row with the target above the scale (int).
    _predictive_measured: whether a measurement has set the scale yet (bool).

A predictive scaler loading a dict without these keys (torch's, or a dynamic scaler's) resets them
and logs a warning saying so; a dynamic scaler loading a predictive dict ignores them and says so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

import torch

from dscale import _predictive
from dscale._grad_measure import NOT_SAMPLED, GradMeasure
from dscale._policy import HostState, ScalePolicy
from dscale._predictive import PredictiveHost

logger = logging.getLogger(__name__)

Policy = Literal["dynamic", "predictive"]
POLICIES = ("dynamic", "predictive")
FORMAT_VERSION = 2
KEYS = ("predictive_margin_log2", "_predictive_rise_tracker", "_predictive_measured")


def check_policy(policy: Any) -> None:
    """ValueError naming ``policy`` and the two choices."""
    if policy not in POLICIES:
        raise ValueError(
            f"policy must be one of {POLICIES}, got {policy!r}; 'dynamic' searches for the "
            "scale by overflowing (torch's rule), 'predictive' sets it from the measured "
            "gradient range"
        )


def _as_number(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


def from_state_dict(state: Mapping[str, Any]) -> PredictiveHost | None:
    """The predictive state in ``state``; None when it has none (it is then reset).

    Raises:
        ValueError: naming the key when a predictive key holds a bad value.
    """
    version = _as_number(state.get("dscale_format_version", 1))
    if version < FORMAT_VERSION or not all(k in state for k in KEYS):
        return None
    margin, rise, measured = (_as_number(state[k]) for k in KEYS)
    limits = (_predictive.MIN_MARGIN_LOG2, _predictive.MAX_MARGIN_LOG2)
    if (
        isinstance(margin, bool)
        or not isinstance(margin, int)
        or not (limits[0] <= margin <= limits[1])
    ):
        raise ValueError(
            f"state_dict: predictive_margin_log2 must be an int in [{limits[0]}, {limits[1]}], "
            f"got {margin!r}"
        )
    if isinstance(rise, bool) or not isinstance(rise, int) or rise < 0:
        raise ValueError(f"state_dict: _predictive_rise_tracker must be an int >= 0, got {rise!r}")
    if measured not in (0, 1, True, False):
        raise ValueError(f"state_dict: _predictive_measured must be a bool, got {measured!r}")
    return PredictiveHost(margin_log2=margin, rise_tracker=rise, measured=bool(measured))


def note_ignored(state: Mapping[str, Any]) -> None:
    """A dynamic scaler loading a predictive dict: say what it leaves out."""
    present = [k for k in KEYS if k in state]
    if present:
        logger.warning(
            "loaded a state dict saved with policy='predictive' into a policy='dynamic' "
            "GradScaler: ignored %s; the scale and the dynamic trackers were loaded",
            present,
        )


class PredictiveScaling:
    """The measurement and the rule's state of one predictive GradScaler."""

    def __init__(self) -> None:
        self.measure = GradMeasure()
        self.host: PredictiveHost | None = PredictiveHost()  # the authority while not None
        self.vector: torch.Tensor | None = None  # float32, PredictiveHost.as_list() order
        self._in_flight: tuple[torch.Tensor, Any | None] | None = None
        self._published = PredictiveHost()
        # This iteration's agreed measurement: host numbers when the host read the vectors.
        self._host_values: tuple[float, float] | None = None
        self._device_values: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------ one iteration
    def begin(self, agreed: list[torch.Tensor], on_host: list[list[float]] | None) -> None:
        """Take this iteration's agreed vectors (MAX over optimizers as over ranks)."""
        from dscale._agreement import GRAD_MAX_ABS, UNDERFLOW

        if on_host is not None:
            self._host_values = (
                max(v[GRAD_MAX_ABS] for v in on_host),
                max(v[UNDERFLOW] for v in on_host),
            )
        stacked = torch.stack([a[GRAD_MAX_ABS : UNDERFLOW + 1] for a in agreed]).amax(0)
        self._device_values = (stacked[0], stacked[1])

    def next_host_state(
        self, policy: ScalePolicy, before: HostState, after: HostState, found: bool
    ) -> HostState:
        """The host form of the rule (plain steps: no device op)."""
        assert self._host_values is not None  # noqa: S101 - begin() got the host vectors
        new, self.host = _predictive.next_host_state(
            policy, before, after, self.read(), found, *self._host_values
        )
        self._end()
        return new

    def before_(self, scale: torch.Tensor) -> torch.Tensor:
        """The scale before the dynamic rule runs (a copy), which the device form needs."""
        return scale.clone()

    def update_(
        self,
        policy: ScalePolicy,
        before_scale: torch.Tensor,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        found_inf: torch.Tensor,
    ) -> None:
        """The device form of the rule (fused and sync-free steps: no host sync)."""
        assert self._device_values is not None  # noqa: S101 - begin() ran
        vector = self._on(scale.device)
        _predictive.update_(
            policy,
            vector,
            before_scale,
            scale,
            growth_tracker,
            found_inf,
            *self._device_values,
        )
        self.host = None
        self._publish(vector)
        self._end()

    def _end(self) -> None:
        self._host_values = self._device_values = None
        self.measure.next_iteration()

    def skip_iteration(self) -> None:
        """update(new_scale=...): no rule ran, but the iteration is over."""
        self._end()

    # ------------------------------------------------------------ where the state lives
    def _on(self, device: torch.device) -> torch.Tensor:
        host = self.host
        if host is not None or self.vector is None:
            values = (host or PredictiveHost()).as_list()
            # non_blocking: a blocking host-to-device copy waits for the GPU (a sync on CUDA).
            self.vector = torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)
        elif self.vector.device != device:
            self.vector = self.vector.to(device)
        return self.vector

    def read(self) -> PredictiveHost:
        """The state as numbers; waits for the GPU only after device-side updates."""
        if self.host is not None:
            return self.host
        assert self.vector is not None  # noqa: S101 - host None only after a device update
        return PredictiveHost.from_list(self.vector.tolist())

    def latest(self) -> PredictiveHost:
        """The newest state the host holds, never waiting (scrape threads)."""
        if self.host is not None:
            return self.host
        in_flight = self._in_flight
        if in_flight is not None and (in_flight[1] is None or in_flight[1].query()):
            return PredictiveHost.from_list(in_flight[0].tolist())
        return self._published

    def _publish(self, vector: torch.Tensor) -> None:
        if vector.device.type != "cuda":
            self._in_flight = (vector.clone(), None)
            return
        previous = self._in_flight
        if previous is not None and (previous[1] is None or previous[1].query()):
            self._published = PredictiveHost.from_list(previous[0].tolist())
        buffer = torch.empty(vector.shape, dtype=vector.dtype, pin_memory=True)
        buffer.copy_(vector, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._in_flight = (buffer, event)  # read only once `event` has completed

    # ------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """The keys this policy adds (see the module docstring)."""
        p = self.read()
        return {
            "dscale_format_version": FORMAT_VERSION,
            "policy": "predictive",
            "predictive_margin_log2": p.margin_log2,
            "_predictive_rise_tracker": p.rise_tracker,
            "_predictive_measured": p.measured,
        }

    def load(self, loaded: PredictiveHost | None) -> None:
        """Replace the state (``from_state_dict``'s result); None resets it and says so."""
        if loaded is None:
            logger.warning(
                "the loaded GradScaler state dict has no predictive state (saved by torch or "
                "by a policy='dynamic' scaler): reset %s to their initial values; the next "
                "clean step sets the scale from the measured gradients",
                list(KEYS),
            )
            loaded = PredictiveHost()
        self.host = loaded
        self._published = loaded
        self._in_flight = None
        self.vector = None

    def snapshot(self, *, wait: bool) -> dict[str, float | int]:
        """Telemetry for ``GradScaler.snapshot()``."""
        p = self.read() if wait else self.latest()
        underflow = p.underflow_fraction
        return {
            "grad_max_abs": p.grad_max_abs,
            "target_scale": p.target_scale,
            "margin_log2": p.margin_log2,
            "underflow_fraction": underflow if underflow != NOT_SAMPLED else float("nan"),
        }

    def __getstate__(self) -> dict[str, Any]:
        host = self.read()
        fresh = PredictiveScaling()
        state = dict(fresh.__dict__)
        state.update(host=host, _published=host)
        state["measure"] = GradMeasure(self.measure.sample_every)
        state["measure"].iteration = self.measure.iteration
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
