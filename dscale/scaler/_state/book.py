"""Where the scale and its trackers live: on the host while every decision is known there.

A plain optimizer step reads the agreed overflow flag on the host anyway (to skip or not), so the
update after it is a few lines of arithmetic (``_policy.next_host_state``); the device only hears
about it when the scale itself changes, because ``scale()`` multiplies by the device tensor. Fused
optimizers and ``sync_free`` decide on the device, so there the update runs as a few tensor ops
on one buffer (``state_buffer``: torch's ``_amp_update_scale_`` and a log row) and the host copy
is dropped for good; reading it back then waits for the GPU.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from dscale.scaler._program import scale_rule as _policy
from dscale.scaler._program import state_buffer as _device_state
from dscale.scaler._program.scale_rule import COUNTER_NAMES, HostState

if TYPE_CHECKING:
    from dscale.scaler._state.predictive import PredictiveScaling


def fresh_host_state(init_scale: float, hysteresis: int) -> HostState:
    """The state of a new scaler."""
    return HostState(_policy.f32(init_scale), 0, hysteresis, (0,) * _policy.NUM_COUNTERS)


class ScaleState:
    """The scale, growth and hysteresis trackers, and event counters of one GradScaler."""

    def __init__(self, host: HostState, tail_words: int = 0) -> None:
        self.host: HostState | None = host  # the authority while not None
        # Words after the state's own for policy="predictive" (dscale/scaler/_state/predictive.py):
        # one buffer, so one copy publishes both.
        self.tail_words = tail_words
        self._flushed: HostState | None = None  # the host state last written to the device
        # The device state (_program/state_buffer.py) and views of it; scale() reads `scale`.
        self.words: torch.Tensor | None = None
        self._log_rows: list[torch.Tensor] | None = None  # views of the log's rows (place())
        self._logged_words: torch.Tensor | None = None  # what a row logs: scale, growth tracker
        self.scale: torch.Tensor | None = None  # fp32, always current
        self.growth_tracker: torch.Tensor | None = None
        self.hysteresis_tracker: torch.Tensor | None = None
        self._rows = 0  # updates logged on the device since the last fold
        self._policy: _policy.ScalePolicy | None = None  # the rule the logged rows ran under
        self._clamped_interval: int | None = None  # see _clamp_tracker
        # After device-side updates: the newest copy of the buffer that has reached the host
        # (buffer, rows, policy, tag), and a newer one that may still be in flight (buffer,
        # event, rows, policy, tag); `tag` is the caller's (the predictive window's position).
        # Read by scrapes.
        self._published: HostState = host
        self._published_words: tuple[torch.Tensor, int, Any, Any] | None = None
        self._in_flight: tuple[torch.Tensor, Any | None, int, Any, Any] | None = None
        # A compiled update() leaves the copy above to the next eager call (publish_if_due).
        self._publish_due = False

    @property
    def placed(self) -> bool:
        return self.scale is not None

    def static_tensors(self) -> list[torch.Tensor]:
        """The device buffer and its views a compiled region reads (``_compiled.mark_static``)."""
        views = (self.words, self.scale, self.growth_tracker, self.hysteresis_tracker, self.tail)
        return [t for t in views if t is not None]

    @property
    def tail(self) -> torch.Tensor | None:
        """The predictive state's words of the device buffer (a view), once placed."""
        return None if self.words is None else self.words[_device_state.WORDS :]

    @property
    def counters(self) -> torch.Tensor | None:
        """The int64 counters as of the last fold (a view); current after :meth:`tensors`."""
        return None if self.words is None else _device_state.counters_view(self.words)

    def place(self, device: torch.device) -> None:
        """Create the device state (the first scale() call decides the device, as torch)."""
        host = self.host
        assert host is not None  # noqa: S101 - the host holds the state until it is placed
        words = torch.zeros(
            _device_state.WORDS + self.tail_words, dtype=torch.float32, device=device
        )
        self.words = words
        # Views made once: each is a dispatched call, and update() writes one row per step.
        self._log_rows = [_device_state.row_view(words, r) for r in range(_device_state.LOG_ROWS)]
        self._logged_words = words[: _device_state.HYSTERESIS]  # scale and growth tracker
        self.scale = words[_device_state.SCALE]
        self.growth_tracker = _device_state.int32_at(words, _device_state.GROWTH)
        self.hysteresis_tracker = _device_state.int32_at(words, _device_state.HYSTERESIS)
        self._write_header(host)

    def _write_header(self, host: HostState) -> None:
        """Make the device state equal ``host`` with an empty log: one host-to-device copy."""
        assert self.words is not None  # noqa: S101
        if torch.compiler.is_compiling():  # the first compiled update after host updates
            _device_state.write_header_traced(self.words, host)
            self._rows = 0
            self._clamped_interval = None
            self._flushed = host
            return
        header = _device_state.header_words(host)
        self.words[: _device_state.LOG].copy_(header.to(self.words.device, non_blocking=True))
        self._rows = 0
        self._clamped_interval = None
        self._flushed = host

    def _flush(self) -> None:
        """Bring the device state up to the host state (kernel launches only)."""
        host = self.host
        if host is None or host is self._flushed or not self.placed:
            return
        self._write_header(host)

    def to_device_form(self) -> None:
        """The form device-side updates leave: the device buffer authoritative, its log folded."""
        self._flush()
        self.fold()
        if self.host is not None:
            self.host = None
            self._publish()

    def fold(self) -> None:
        """Fold the logged updates into the device counters (a few ops; no host sync)."""
        if self._rows and self.words is not None and self._policy is not None:
            _device_state.fold_on_device(self.words, self._rows, self._policy)
            self._rows = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        """The live device tensors, brought up to date first (no host sync)."""
        self._flush()
        self.fold()
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
        assert self.words is not None  # noqa: S101
        return _device_state.fold_on_host(self.words.cpu(), self._rows, self._policy)

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
            return _device_state.fold_on_host(in_flight[0], in_flight[2], in_flight[3])
        return self._published

    def latest_words(self) -> tuple[torch.Tensor, int, Any, Any] | None:
        """The newest host copy of the buffer (buffer, rows, policy, tag); like :meth:`latest`,
        it never waits and never writes, so a scrape thread may call it."""
        in_flight = self._in_flight
        if in_flight is not None and (in_flight[1] is None or in_flight[1].query()):
            buffer, _, rows, policy, tag = in_flight
            return (buffer, rows, policy, tag)
        return self._published_words

    def words_now(self, tag: Any) -> tuple[torch.Tensor, int, Any, Any] | None:
        """A host copy of the current buffer (waits for the GPU); None while the host holds it."""
        if self.host is not None or self.words is None:
            return None
        return (self.words.cpu(), self._rows, self._policy, tag)

    def _land(self) -> None:
        """Take the in-flight copy as published once it has reached the host (training thread)."""
        in_flight = self._in_flight
        if in_flight is not None and (in_flight[1] is None or in_flight[1].query()):
            buffer, _, rows, policy, tag = in_flight
            self._published = _device_state.fold_on_host(buffer, rows, policy)
            self._published_words = (buffer, rows, policy, tag)
            self._in_flight = None

    def _publish(self, tag: Any = None) -> None:
        """Start copying the device state to the host (non-blocking); :meth:`latest` reads it."""
        words = self.words
        assert words is not None  # noqa: S101
        if words.device.type != "cuda":
            # On the host already; a copy, since the live buffer changes at the next update.
            self._in_flight = (words.clone(), None, self._rows, self._policy, tag)
            return
        self._land()
        buffer = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
        buffer.copy_(words, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        # Read only once `event` has completed (latest() queries it, never waits on it).
        self._in_flight = (buffer, event, self._rows, self._policy, tag)

    def _clamp_tracker(self, policy: _policy.ScalePolicy) -> None:
        """Keep the tracker below the interval, once per interval (torch's kernel grows at ==).

        dscale grows at >= so that a growth_interval lowered mid-run still lets the scale grow; a
        tracker clamped to interval - 1 grows at the next clean step under either test, and stays
        below the interval after that, so the clamp runs only when the interval or state changed.
        """
        if self._clamped_interval != policy.growth_interval:
            assert self.growth_tracker is not None  # noqa: S101
            self.growth_tracker.clamp_(max=policy.growth_interval - 1)
            self._clamped_interval = policy.growth_interval

    def update(
        self,
        policy: _policy.ScalePolicy,
        found_inf: torch.Tensor | None,
        found: bool | None,
        predictive: PredictiveScaling | None = None,
        *,
        pinned: bool = False,
    ) -> None:
        """Apply one iteration: on the host when ``found`` is known there, else on the device.

        ``pinned``: the scale never moves (a StepGuard's 1, with hysteresis 1): on the device
        torch's kernel with factors 1.0 keeps the tracker exactly as the clamped rule does, in
        one op instead of the general rule's twenty.

        ``found_inf`` (the agreed flag as a tensor) is needed for the device path only. The
        device path is the scale rule, one row written to the log, and one copy to publish.

        ``predictive`` (policy="predictive", ``dscale.scaler._program.predictive``) adjusts the
        dynamic rule's result in the same place, before anyone can read it.
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
        if torch.compiler.is_compiling():
            self._traced_update(policy, found_inf, predictive, pinned=pinned)
            return
        assert self.words is not None and self.scale is not None  # noqa: S101
        assert self.growth_tracker is not None and self.hysteresis_tracker is not None  # noqa: S101
        if (policy is not self._policy and policy != self._policy) or (
            self._rows == _device_state.LOG_ROWS
        ):
            self.fold()  # rows are folded under the rule they ran under
            self._policy = policy
        flag = found_inf  # the agreed vector's field: 0-d fp32 on the scale's device, as a rule
        if flag.dtype != torch.float32 or flag.dim() or flag.device != self.scale.device:
            flag = flag.to(self.scale.device).float().reshape(())
        lean = predictive is not None and predictive.is_lean(policy)
        before = self.scale.clone() if predictive is not None and not lean else None
        if lean:
            pass  # the predictive rule alone sets the scale (dscale/scaler/_program/predictive.py)
        elif _policy.is_torch_rule(policy) or (pinned and policy.hysteresis == 1):
            self._clamp_tracker(policy)
            factors = (1.0, 1.0) if pinned else (policy.growth_factor, policy.backoff_factor)
            torch._amp_update_scale_(
                self.scale, self.growth_tracker, flag, *factors, policy.growth_interval
            )
        else:
            _policy.update_(policy, self.scale, self.growth_tracker, self.hysteresis_tracker, flag)
        if predictive is not None:
            assert self.tail is not None  # noqa: S101 - the scaler sized it for the policy
            predictive.update_(policy, self.tail, self.scale, before, flag)
        assert self._log_rows is not None and self._logged_words is not None  # noqa: S101
        torch.cat([flag.reshape(1), self._logged_words], out=self._log_rows[self._rows])
        self._rows += 1
        self.host = None
        self._publish(None if predictive is None else predictive.pos["window"])

    def _traced_update(
        self,
        policy: _policy.ScalePolicy,
        flag: torch.Tensor,
        predictive: PredictiveScaling | None,
        *,
        pinned: bool,
    ) -> None:
        """:meth:`update` under torch.compile: the same rule, then the update folded into the
        counters at once instead of a log row, so that no per-step Python number (the log's row
        count) enters the traced region. The views are made from ``words`` inside the graph
        (AOTAutograd refuses one input mutated through views of two dtypes), and the copy for
        scrapes is left to the next eager call (:meth:`publish_if_due`)."""
        words = self.words
        assert words is not None  # noqa: S101 - placed by scale()
        if self._rows and self._policy is not None:  # eager updates logged before: fold them
            _device_state.fold_on_device(words, self._rows, self._policy)
            self._rows = 0
        self._policy = policy
        flag = flag.to(words.device).float().reshape(())
        scale = words[_device_state.SCALE]
        growth = _device_state.int32_at(words, _device_state.GROWTH)
        hysteresis = _device_state.int32_at(words, _device_state.HYSTERESIS)
        lean = predictive is not None and predictive.is_lean(policy)
        before = scale.clone()
        if lean:
            pass  # the predictive rule alone sets the scale
        elif _policy.is_torch_rule(policy) or (pinned and policy.hysteresis == 1):
            growth.clamp_(max=policy.growth_interval - 1)  # idempotent: see _clamp_tracker
            factors = (1.0, 1.0) if pinned else (policy.growth_factor, policy.backoff_factor)
            _policy.torch_rule_(scale, growth, flag, *factors, policy.growth_interval)
        else:
            _policy.update_(policy, scale, growth, hysteresis, flag)
        if predictive is not None:
            tail = words[_device_state.WORDS :]
            predictive.update_(policy, tail, scale, None if lean else before, flag)
        _device_state.fold_row_on_device(words, policy, flag, before, growth)
        self._clamped_interval = None
        self.host = None
        self._publish_due = True

    def publish_if_due(self, tag: Any = None) -> None:
        """Start the copy for scrapes that compiled updates left (an eager call: scale())."""
        if self._publish_due:
            self._publish_due = False
            self._publish(tag)

    def set_scale(self, new_scale: float | torch.Tensor) -> None:
        """``update(new_scale=...)``: a float keeps the host copy, a tensor moves to the device.

        Not a growth or a back-off: the log is folded first and the jump starts a new fold.
        """
        assert self.scale is not None and self.words is not None  # noqa: S101
        if isinstance(new_scale, torch.Tensor):
            self._flush()
            self.fold()
            self.scale.copy_(new_scale.detach().reshape(()))
            self.words[_device_state.FOLD_SCALE].copy_(self.scale)
            self.host = None
            self._publish()
            return
        if self.host is not None:
            self.host = dataclasses.replace(self.host, scale=_policy.f32(new_scale))
            self.scale.fill_(new_scale)
            return
        self.fold()
        self.scale.fill_(new_scale)
        self.words[_device_state.FOLD_SCALE].fill_(new_scale)
        self._publish()

    def load(self, host: HostState) -> None:
        """Replace the whole state (load_state_dict).

        A state kept on the device (device-side or compiled updates) stays there: the loaded
        values are written to the buffer now, eagerly, so that a compiled update() after the load
        finds the state in the form it was traced with (the loaded numbers would otherwise be
        baked into a new graph: a recompile per load).
        """
        on_device = self.host is None and self.placed
        self.host = host
        self._published = host
        self._published_words = None
        self._in_flight = None
        self._flushed = None
        self._flush()
        if on_device:
            self.host = None
            self._publish()

    def __getstate__(self) -> dict[str, Any]:
        # Tensors are not pickled (torch's scaler does the same): the copy starts on the host.
        state = self.read()
        return {
            "host": state,
            "_flushed": None,
            "words": None,
            "_log_rows": None,
            "_logged_words": None,
            "scale": None,
            "growth_tracker": None,
            "hysteresis_tracker": None,
            "_rows": 0,
            "_policy": None,
            "_clamped_interval": None,
            "_published": state,
            "_published_words": None,
            "_in_flight": None,
            "_publish_due": False,
            "tail_words": self.tail_words,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Pickled before the state buffer existed: its tensors were not pickled either.
        state.pop("counters", None)  # now a view of the buffer
        for name, default in (
            ("words", None),
            ("_log_rows", None),
            ("_logged_words", None),
            ("_rows", 0),
            ("_policy", None),
        ):
            state.setdefault(name, default)
        state.setdefault("_clamped_interval", None)
        state.setdefault("tail_words", 0)
        state.setdefault("_published_words", None)
        state.setdefault("_publish_due", False)
        self.__dict__.update(state)
