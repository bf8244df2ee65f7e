"""A predictive GradScaler's own state: its window, where it lives, its state-dict keys.

Like the scale (``_scale_state``), the window stays on the host while every decision is known
there (plain optimizer steps) and moves to the device after a fused or ``sync_free`` step, into
the tail of the scale state's own buffer, so the device update needs no extra copy to publish it.

Device tail layout (float32 words after the scale state's): ``[underflow share + 1 (0: never
sampled), window...]``.

State-dict keys (format version 4; a dynamic scaler's dict stays version 1):
    policy: "predictive" (informational; the constructor's ``policy`` decides).
    predictive_window: the window's entries (a list of float32 values, ring order; a 1-D tensor
        in a ``dscale.checkpoint`` checkpoint).
    _predictive_window_pos: the slot the next entry overwrites (int).

A predictive scaler loading a dict without these keys (torch's, a dynamic scaler's, or one from
before version 4, of the earlier margin rule) starts with an empty window and logs a warning
saying so; a window of another length keeps its newest entries; a dynamic scaler loading a
predictive dict ignores the keys and says so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Literal

import torch

from dscale import _device_state, _predictive
from dscale._grad_measure import GradMeasure
from dscale._policy import HostState, ScalePolicy
from dscale._predictive import Telemetry, Window

logger = logging.getLogger(__name__)

Policy = Literal["dynamic", "predictive"]
POLICIES = ("dynamic", "predictive")
FORMAT_VERSION = 4
KEYS = ("predictive_window", "_predictive_window_pos")
#: Keys of the version 2 (margin rule) dicts: read as "no window", and said so.
OLD_KEYS = ("predictive_margin_log2", "_predictive_rise_tracker", "_predictive_measured")
TAIL_UNDERFLOW = 0
TAIL_WINDOW = 1


def check_policy(policy: Any) -> None:
    """ValueError naming ``policy`` and the two choices."""
    if policy not in POLICIES:
        raise ValueError(
            f"policy must be one of {POLICIES}, got {policy!r}; 'dynamic' searches for the "
            "scale by overflowing (torch's rule), 'predictive' sets it from the measured "
            "gradient range"
        )


def check_window(window: Any) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"predictive_window must be an int >= 1, got {window!r}; it is the number of steps "
            "a measured spike or an overflow is remembered (default: growth_interval)"
        )


def tail_words(window: int) -> int:
    """Words the predictive state adds to the scale state's device buffer."""
    return TAIL_WINDOW + window


def _as_number(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def from_state_dict(state: Mapping[str, Any]) -> tuple[list[float], int] | None:
    """The window and position in ``state``; None when it has none (the window starts empty).

    Raises:
        ValueError: naming the key when a predictive key holds a bad value.
    """
    version = _as_number(state.get("dscale_format_version", 1))
    if version < FORMAT_VERSION or not all(k in state for k in KEYS):
        return None
    window, pos = state[KEYS[0]], _as_number(state[KEYS[1]])
    if isinstance(window, (list, tuple)):
        window = torch.tensor(window, dtype=torch.float32)
    if (
        not isinstance(window, torch.Tensor)
        or window.dim() != 1
        or window.numel() < 1
        or not bool(torch.isfinite(window).all())
        or bool((window < 0).any())
    ):
        raise ValueError(
            "state_dict: predictive_window must be a non-empty list of finite values >= 0, got "
            f"{_short(window)}"
        )
    if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < window.numel():
        raise ValueError(
            f"state_dict: _predictive_window_pos must be an int in [0, {window.numel()}), "
            f"got {pos!r}"
        )
    return [float(v) for v in window.float().tolist()], pos


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _resized(slots: list[float], pos: int, length: int) -> tuple[list[float], int]:
    """A window of ``length`` slots holding the newest entries of ``slots``, oldest first."""
    n = len(slots)
    ordered = [slots[(pos + k) % n] for k in range(n)]  # oldest to newest
    kept = ordered[-length:]
    return [0.0] * (length - len(kept)) + kept, 0


def note_ignored(state: Mapping[str, Any]) -> None:
    """A dynamic scaler loading a predictive dict: say what it leaves out."""
    present = [k for k in (*KEYS, *OLD_KEYS) if k in state]
    if present:
        logger.warning(
            "loaded a state dict saved with policy='predictive' into a policy='dynamic' "
            "GradScaler: ignored %s; the scale and the dynamic trackers were loaded",
            present,
        )


class PredictiveScaling:
    """The measurement, the window and the telemetry of one predictive GradScaler."""

    def __init__(self, window: int) -> None:
        self.length = window
        self.measure = GradMeasure()
        self.host: Window | None = Window([0.0] * window, 0)  # the authority while not None
        self.pos = 0  # the device window's next slot (while host is None)
        self.telemetry = Telemetry()  # host form's; replaced whole (scrapes read it)
        self._budget: torch.Tensor | None = None
        self._tail: torch.Tensor | None = None  # the device window's buffer, once it is there
        # This iteration's agreed measurement: host numbers when the host read the vectors.
        self._host_values: tuple[float, float] | None = None
        self._device_values: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------ one iteration
    def begin(self, agreed: list[torch.Tensor], on_host: list[list[float]] | None, at: int) -> None:
        """Take this iteration's agreed vectors (MAX over optimizers as over ranks).

        ``at``: the index of the measurement in them (``_agreement.measured_at``).
        """
        if on_host is not None:
            self._host_values = (max(v[at] for v in on_host), max(v[at + 1] for v in on_host))
        if len(agreed) == 1:
            self._device_values = (agreed[0][at], agreed[0][at + 1])
        else:
            stacked = torch.stack([a[at : at + 2] for a in agreed]).amax(0)
            self._device_values = (stacked[0], stacked[1])

    def next_host_state(
        self, policy: ScalePolicy, before: HostState, after: HostState, found: bool
    ) -> HostState:
        """The host form of the rule (plain steps: no device op)."""
        assert self._host_values is not None and self.host is not None  # noqa: S101
        measured, underflow = self._host_values
        new, entry = _predictive.next_host_state(policy, before, after, self.host, found, measured)
        window_max = self.host.max
        t = self.telemetry
        self.telemetry = Telemetry(
            grad_max_abs=t.grad_max_abs if found else entry,
            window_max=window_max,
            target_scale=(
                _predictive.target_scale(policy, window_max)
                if window_max > _predictive.TINY
                else math.nan
            ),
            underflow_fraction=underflow - 1.0 if underflow > 0 else t.underflow_fraction,
        )
        self._end()
        return new

    def is_lean(self, policy: ScalePolicy) -> bool:
        """Whether the device update runs without the dynamic rule (``_predictive.is_lean``)."""
        return _predictive.is_lean(policy)

    def update_(
        self,
        policy: ScalePolicy,
        tail: torch.Tensor,
        scale: torch.Tensor,
        before: torch.Tensor | None,
        found_inf: torch.Tensor,
    ) -> None:
        """The device form of the rule (fused and sync-free steps: no host sync).

        ``tail``: this state's words in the scale state's buffer; ``before``: the step's scale
        when ``scale`` already holds the dynamic rule's result (None for the lean rule).
        """
        assert self._device_values is not None  # noqa: S101 - begin() ran
        measured, underflow = self._device_values
        self._to_device(tail)
        self._tail = tail
        budget = self._budget
        if budget is None or budget.device != tail.device:
            budget = self._budget = torch.full((), _predictive.BUDGET, device=tail.device)
        window = tail[TAIL_WINDOW:]
        _predictive.update_(policy, window, self.pos, scale, before, found_inf, measured, budget)
        self.pos = (self.pos + 1) % self.length
        if self.measure.sampling:  # the only steps whose vector carries a share
            tail[TAIL_UNDERFLOW].copy_(underflow)
        self._end()

    def _to_device(self, tail: torch.Tensor) -> None:
        """Hand the window to the device buffer (once, after plain steps; no host sync)."""
        host = self.host
        if host is None:
            return
        underflow = self.telemetry.underflow_fraction
        values = [0.0 if math.isnan(underflow) else underflow + 1.0, *host.slots]
        # non_blocking: a blocking host-to-device copy waits for the GPU (a sync on CUDA).
        tail.copy_(torch.tensor(values, dtype=torch.float32).to(tail.device, non_blocking=True))
        self.pos = host.pos
        self.host = None

    def _end(self) -> None:
        self._host_values = self._device_values = None
        self.measure.next_iteration()

    def skip_iteration(self) -> None:
        """update(new_scale=...): no rule ran, but the iteration is over."""
        self._end()

    # ------------------------------------------------------------ reading it back
    def window(self) -> tuple[list[float], int]:
        """The window in ring order and its position; waits for the GPU after device updates."""
        if self.host is not None:
            return list(self.host.slots), self.host.pos
        assert self._tail is not None  # noqa: S101 - host None only after a device update
        return self._tail[TAIL_WINDOW:].tolist(), self.pos

    def telemetry_from(
        self, words: torch.Tensor | None, rows: int, pos: int, policy: ScalePolicy | None
    ) -> Telemetry:
        """Telemetry from a host copy of the scale state's buffer (after device updates)."""
        if self.host is not None or words is None or policy is None:
            return self.telemetry
        tail = words[_device_state.WORDS :]
        window = tail[TAIL_WINDOW:]
        window_max = float(window.max())
        newest = float(window[(pos - 1) % self.length])
        last_row = _device_state.LOG + _device_state.ROW * (rows - 1)
        overflowed = rows > 0 and float(words[last_row]) > 0
        underflow = float(tail[TAIL_UNDERFLOW])
        return Telemetry(
            grad_max_abs=math.nan if overflowed else newest,
            window_max=window_max,
            target_scale=(
                _predictive.target_scale(policy, window_max)
                if window_max > _predictive.TINY
                else math.nan
            ),
            underflow_fraction=underflow - 1.0 if underflow > 0 else math.nan,
        )

    # ------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """The keys this policy adds (see the module docstring)."""
        slots, pos = self.window()
        return {
            "dscale_format_version": FORMAT_VERSION,
            "policy": "predictive",
            "predictive_window": slots,
            "_predictive_window_pos": pos,
        }

    def load(self, loaded: tuple[list[float], int] | None) -> None:
        """Replace the window (``from_state_dict``'s result); None empties it and says so."""
        if loaded is None:
            logger.warning(
                "the loaded GradScaler state dict has no predictive window (saved by torch, by "
                "a policy='dynamic' scaler or by dscale before format version %d): the window "
                "starts empty; the next clean step sets the scale from the measured gradients",
                FORMAT_VERSION,
            )
            loaded = ([0.0] * self.length, 0)
        slots, pos = loaded
        if len(slots) != self.length:
            logger.warning(
                "the loaded predictive window has %d entries, this scaler's predictive_window "
                "is %d: kept the newest %d",
                len(slots),
                self.length,
                min(len(slots), self.length),
            )
            slots, pos = _resized(slots, pos, self.length)
        self.host = Window(list(slots), pos)
        self.pos = pos
        window_max = self.host.max
        self.telemetry = Telemetry(window_max=window_max)

    def snapshot(self, telemetry: Telemetry) -> dict[str, float | int]:
        """Telemetry fields of ``GradScaler.snapshot()``."""
        return {
            "grad_max_abs": telemetry.grad_max_abs,
            "target_scale": telemetry.target_scale,
            "margin_log2": _predictive.MARGIN_LOG2,
            "underflow_fraction": telemetry.underflow_fraction,
        }

    def __getstate__(self) -> dict[str, Any]:
        # Device tensors are not pickled (as torch's scaler): the copy starts on the host.
        slots, pos = self.window()
        underflow = self.telemetry.underflow_fraction
        if self.host is None and self._tail is not None:
            share = float(self._tail[TAIL_UNDERFLOW])
            underflow = share - 1.0 if share > 0 else math.nan
        fresh = PredictiveScaling(self.length)
        fresh.load((slots, pos))
        fresh.telemetry = Telemetry(
            window_max=fresh.telemetry.window_max, underflow_fraction=underflow
        )
        fresh.measure.iteration = self.measure.iteration
        fresh.measure.sample_every = self.measure.sample_every
        return fresh.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
