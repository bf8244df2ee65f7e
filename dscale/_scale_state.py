"""Where the scale and its trackers live: on the host while every decision is known there.

A plain optimizer step reads the agreed overflow flag on the host anyway (to skip or not), so the
update after it is a few lines of arithmetic (``_policy.next_host_state``); the device only hears
about it when the scale itself changes, because ``scale()`` multiplies by the device tensor. Fused
optimizers and ``sync_free`` decide on the device, so there the update runs as tensor ops
(``_policy.update_``) and the host copy is dropped for good; reading it back then waits for the GPU.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from dscale import _policy
from dscale._policy import COUNTER_NAMES, HostState

if TYPE_CHECKING:
    from dscale._predictive_state import PredictiveScaling


def fresh_host_state(init_scale: float, hysteresis: int) -> HostState:
    """The state of a new scaler."""
    return HostState(_policy.f32(init_scale), 0, hysteresis, (0,) * _policy.NUM_COUNTERS)


class ScaleState:
    """The scale, growth and hysteresis trackers, and event counters of one GradScaler."""

    def __init__(self, host: HostState) -> None:
        self.host: HostState | None = host  # the authority while not None
        self._flushed: HostState | None = None  # the host state last written to the device
        self.scale: torch.Tensor | None = None  # fp32, always current: scale() reads it
        self.growth_tracker: torch.Tensor | None = None
        self.hysteresis_tracker: torch.Tensor | None = None
        self.counters: torch.Tensor | None = None
        # After device-side updates: the newest state that has reached the host, and a copy of a
        # newer one that may still be in flight (pinned buffer, event). Read by scrape threads.
        self._published: HostState = host
        self._in_flight: tuple[torch.Tensor, Any | None] | None = None

    @property
    def placed(self) -> bool:
        return self.scale is not None

    def place(self, device: torch.device) -> None:
        """Create the device tensors (the first scale() call decides the device, as torch)."""
        host = self.host
        assert host is not None  # noqa: S101 - the host holds the state until it is placed
        self.scale = torch.full((), host.scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.full((), host.growth_tracker, dtype=torch.int32, device=device)
        self.hysteresis_tracker = torch.full(
            (), host.hysteresis_tracker, dtype=torch.int32, device=device
        )
        self.counters = torch.tensor(host.counters, dtype=torch.int64, device=device)
        self._flushed = host

    def _flush(self) -> None:
        """Bring the device trackers and counters up to the host state (kernel launches only)."""
        host = self.host
        if host is None or host is self._flushed or not self.placed:
            return
        assert self.scale is not None and self.counters is not None  # noqa: S101
        assert self.growth_tracker is not None and self.hysteresis_tracker is not None  # noqa: S101
        old = self._flushed
        if old is None or old.scale != host.scale:
            self.scale.fill_(host.scale)
        if old is None or old.growth_tracker != host.growth_tracker:
            self.growth_tracker.fill_(host.growth_tracker)
        if old is None or old.hysteresis_tracker != host.hysteresis_tracker:
            self.hysteresis_tracker.fill_(host.hysteresis_tracker)
        for i, value in enumerate(host.counters):
            if old is None or old.counters[i] != value:
                self.counters[i].fill_(value)
        self._flushed = host

    def tensors(self) -> dict[str, torch.Tensor]:
        """The live device tensors, brought up to date first (no host sync)."""
        self._flush()
        c = self.counters
        assert c is not None and self.scale is not None  # noqa: S101
        assert self.growth_tracker is not None and self.hysteresis_tracker is not None  # noqa: S101
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
            **{name: c[i] for i, name in enumerate(COUNTER_NAMES)},
        }

    def read(self) -> HostState:
        """The current state as Python numbers; waits for the GPU only after device updates."""
        host = self.host
        if host is not None:
            return host
        assert self.scale is not None and self.counters is not None  # noqa: S101
        assert self.growth_tracker is not None and self.hysteresis_tracker is not None  # noqa: S101
        packed = _pack(self.scale, self.growth_tracker, self.hysteresis_tracker, self.counters)
        return _unpack(packed.tolist())

    def latest(self) -> HostState:
        """The newest state the host holds, without writing or waiting on any device tensor.

        Safe from another thread (a metrics scrape). After device-side updates it may be one or
        two updates behind, while the copy of the newest one is still in flight.
        """
        host = self.host
        if host is not None:
            return host
        in_flight = self._in_flight
        if in_flight is not None and (in_flight[1] is None or in_flight[1].query()):
            return _unpack(in_flight[0].tolist())
        return self._published

    def _publish(self) -> None:
        """Start copying the device state to the host (non-blocking); :meth:`latest` reads it."""
        assert self.scale is not None and self.counters is not None  # noqa: S101
        assert self.growth_tracker is not None and self.hysteresis_tracker is not None  # noqa: S101
        packed = _pack(self.scale, self.growth_tracker, self.hysteresis_tracker, self.counters)
        if packed.device.type != "cuda":
            self._in_flight = (packed, None)  # on the host already; a reader unpacks it
            return
        previous = self._in_flight
        if previous is not None and (previous[1] is None or previous[1].query()):
            self._published = _unpack(previous[0].tolist())
        buffer = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        buffer.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        # Read only once `event` has completed (latest() queries it, never waits on it).
        self._in_flight = (buffer, event)

    def update(
        self,
        policy: _policy.ScalePolicy,
        found_inf: torch.Tensor | None,
        found: bool | None,
        predictive: PredictiveScaling | None = None,
    ) -> None:
        """Apply one iteration: on the host when ``found`` is known there, else on the device.

        ``found_inf`` (the agreed flag as a tensor) is needed for the device path only.

        ``predictive`` (policy="predictive", ``dscale._predictive``) adjusts the dynamic rule's
        result in the same place, before anyone can read it.
        """
        host = self.host
        if found is not None and host is not None:
            new = _policy.next_host_state(policy, host, found)
            if predictive is not None:
                new = predictive.next_host_state(policy, host, new, found)
            if new.scale != host.scale:
                assert self.scale is not None  # noqa: S101
                self.scale.fill_(new.scale)
            self.host = new
            return
        self._flush()
        assert found_inf is not None  # noqa: S101 - GradScaler passes it for this path
        assert self.scale is not None and self.counters is not None  # noqa: S101
        assert self.growth_tracker is not None and self.hysteresis_tracker is not None  # noqa: S101
        before = None if predictive is None else predictive.before_(self.scale, self.counters)
        _policy.update_(
            policy,
            self.scale,
            self.growth_tracker,
            self.hysteresis_tracker,
            self.counters,
            found_inf,
        )
        if predictive is not None and before is not None:
            predictive.update_(
                policy, before, self.scale, self.growth_tracker, self.counters, found_inf
            )
        self.host = None
        self._publish()

    def set_scale(self, new_scale: float | torch.Tensor) -> None:
        """``update(new_scale=...)``: a float keeps the host copy, a tensor moves to the device."""
        assert self.scale is not None  # noqa: S101
        if isinstance(new_scale, torch.Tensor):
            self._flush()
            self.scale.copy_(new_scale.detach().reshape(()))
            self.host = None
            self._publish()
            return
        if self.host is not None:
            self.host = dataclasses.replace(self.host, scale=_policy.f32(new_scale))
        self.scale.fill_(new_scale)

    def load(self, host: HostState) -> None:
        """Replace the whole state (load_state_dict)."""
        self.host = host
        self._published = host
        self._in_flight = None
        self._flushed = None
        self._flush()

    def __getstate__(self) -> dict[str, Any]:
        # Tensors are not pickled (torch's scaler does the same): the copy starts on the host.
        return {
            "host": self.read(),
            "_flushed": None,
            "scale": None,
            "growth_tracker": None,
            "hysteresis_tracker": None,
            "counters": None,
            "_published": self.read(),
            "_in_flight": None,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _pack(
    scale: torch.Tensor, growth: torch.Tensor, hysteresis: torch.Tensor, counters: torch.Tensor
) -> torch.Tensor:
    # fp64 holds the fp32 scale and every int counter below 2**53 exactly.
    parts = [scale.double().reshape(1), growth.double().reshape(1), hysteresis.double().reshape(1)]
    return torch.cat([*parts, counters.double()])


def _unpack(values: list[float]) -> HostState:
    scale, growth, hyst, *counts = values
    return HostState(scale, int(growth), int(hyst), tuple(int(c) for c in counts))
