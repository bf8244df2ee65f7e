"""A predictive GradScaler's own state: its two rings, where they live, its state-dict keys.

Like the scale (``_state.book``), the rings stay on the host while every decision is known there
(plain optimizer steps) and move to the device after a fused or ``sync_free`` step, into the tail
of the scale state's own buffer, so the device update needs no extra copy to publish them.

Device tail layout (float32 words after the scale state's): ``[underflow share + 1 (0: never
sampled), the last step's ask (its measurement in scaled units, BUDGET: measured nothing), FLOOR,
memory ring..., window ring...]`` (``predictive`` says what each holds). The ask and the overflow
counters tell what the last step measured whatever happened since (a fold of the log, a scale set
by ``update(new_scale=...)``), as the host form's telemetry does.

State-dict keys (format version 4; a dynamic scaler's dict stays version 1):
    policy: "predictive" (informational; the constructor's ``policy`` decides).
    predictive_window, predictive_memory: the rings' entries (lists of float32 values, ring
        order; 1-D tensors in a ``dscale.checkpoint`` checkpoint).
    _predictive_window_pos, _predictive_memory_pos: the slot each ring overwrites next (int).

A predictive scaler loading a dict without these keys (torch's, a dynamic scaler's, or one from
before version 4, of the earlier margin rule) starts with empty rings and logs a warning saying
so; a ring of another length keeps its newest entries, and says so; a dynamic scaler loading a
predictive dict ignores the keys and says so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Literal

import torch

from dscale.scaler._program import predictive as _predictive
from dscale.scaler._program import state_buffer as _device_state
from dscale.scaler._program.grad_measure import GradMeasure
from dscale.scaler._program.predictive import Telemetry, Window
from dscale.scaler._program.scale_rule import SKIPPED_IN_A_ROW, HostState, ScalePolicy

logger = logging.getLogger(__name__)

Policy = Literal["dynamic", "predictive"]
POLICIES = ("dynamic", "predictive")
FORMAT_VERSION = 4
RINGS = ("window", "memory")
KEYS = tuple(k for r in RINGS for k in (f"predictive_{r}", f"_predictive_{r}_pos"))
#: Keys of the version 2 (margin rule) dicts: read as "no rings", and said so.
OLD_KEYS = ("predictive_margin_log2", "_predictive_rise_tracker", "_predictive_measured")
#: The measurement window's default length (``GradScaler(predictive_window=...)``).
DEFAULT_WINDOW = 8
TAIL_UNDERFLOW = 0
TAIL_ASKED = 1
TAIL_FLOOR = 2
TAIL_RINGS = 3

Ring = tuple[list[float], int]  # entries in ring order, the slot the next entry overwrites


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
            f"predictive_window must be an int >= 1, got {window!r}; it is the number of recent "
            f"steps whose largest gradient sets the scale (default {DEFAULT_WINDOW})"
        )


def tail_words(window: int, memory: int) -> int:
    """Words the predictive state adds to the scale state's device buffer."""
    return TAIL_RINGS + memory + window


def _as_number(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _ring(state: Mapping[str, Any], name: str) -> Ring:
    entries, pos = state[f"predictive_{name}"], _as_number(state[f"_predictive_{name}_pos"])
    if isinstance(entries, (list, tuple)):
        try:
            entries = torch.tensor(entries, dtype=torch.float32)
        except (TypeError, ValueError):
            pass
    if (
        not isinstance(entries, torch.Tensor)
        or entries.dim() != 1
        or entries.numel() < 1
        or not bool(torch.isfinite(entries).all())
        or bool((entries < 0).any())
    ):
        raise ValueError(
            f"state_dict: predictive_{name} must be a non-empty list of finite values >= 0, "
            f"got {_short(entries)}"
        )
    if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < entries.numel():
        raise ValueError(
            f"state_dict: _predictive_{name}_pos must be an int in [0, {entries.numel()}), "
            f"got {pos!r}"
        )
    return [float(v) for v in entries.float().tolist()], pos


def from_state_dict(state: Mapping[str, Any]) -> dict[str, Ring] | None:
    """The rings in ``state``; None when it has none (the rings then start empty).

    Raises:
        ValueError: naming the key when a predictive key holds a bad value.
    """
    version = _as_number(state.get("dscale_format_version", 1))
    if version < FORMAT_VERSION or not all(k in state for k in KEYS):
        return None
    return {name: _ring(state, name) for name in RINGS}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _turned(slots: list[float], pos: int, by: int) -> tuple[list[float], int]:
    """The same ring (``slots``, next slot ``pos``) with its next slot at ``pos + by``."""
    n = len(slots)
    at = (pos + by) % n
    out = [0.0] * n
    for k in range(n):  # oldest first
        out[(at + k) % n] = slots[(pos + k) % n]
    return out, at


def _resized(ring: Ring, length: int) -> Ring:
    """A ring of ``length`` slots holding the newest entries of ``ring``."""
    slots, pos = ring
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
    """The measurement, the two rings and the telemetry of one predictive GradScaler."""

    def __init__(self, window: int, memory: int) -> None:
        self.lengths = {"window": window, "memory": memory}
        self.measure = GradMeasure()
        # The authority while not None (plain steps); then the device tail.
        self.host: dict[str, Window] | None = {
            name: Window([0.0] * n, 0) for name, n in self.lengths.items()
        }
        self.pos = {"window": 0, "memory": 0}  # the device rings' next slots (host None)
        # Compiled updates turn the device rings under fixed positions (no per-step Python
        # number in the traced region); the saved form turns the positions instead, as eager
        # updates do: `shift` is how far each saved position is ahead of `pos`, and `turned`
        # is set by a compiled update until the next eager call counts it (settle()).
        self.shift = {"window": 0, "memory": 0}
        self.turned = False
        self.loaded = False  # rings loaded onto the device: telemetry as loaded until an update
        self.telemetry = Telemetry()  # host form's; replaced whole (scrapes read it)
        self._budget: torch.Tensor | None = None
        self._tail: torch.Tensor | None = None  # the device tail, once the rings are there
        # This iteration's agreed measurement: host numbers when the host read the vectors.
        self._host_values: tuple[float, float] | None = None
        self._device_values: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------ one iteration
    def begin(
        self,
        agreed: list[torch.Tensor],
        on_host: list[list[float]] | None,
        at: int,
        *,
        spiked: list[torch.Tensor] | None = None,
        spiked_on_host: bool = False,
    ) -> None:
        """Take this iteration's agreed vectors (MAX over optimizers as over ranks).

        ``at``: the index of the measurement in them (``layout.start("measured")``). ``spiked``:
        the spike gate's decisions (> 0: skipped for a spike; ``spiked_on_host`` as known on
        the host), which make the step one that measured nothing.
        """
        if on_host is not None:
            measured = 0.0 if spiked_on_host else max(v[at] for v in on_host)
            self._host_values = (measured, max(v[at + 1] for v in on_host))
        if len(agreed) == 1:
            values = (agreed[0][at], agreed[0][at + 1])
        else:
            stacked = torch.stack([a[at : at + 2] for a in agreed]).amax(0)
            values = (stacked[0], stacked[1])
        if spiked:  # the spike gate is on: a few ops more
            spike = spiked[0] if len(spiked) == 1 else torch.stack(spiked).amax()
            values = (torch.where(spike > 0, 0.0, values[0]), values[1])
        self._device_values = values

    def next_host_state(
        self, policy: ScalePolicy, before: HostState, after: HostState, found: bool
    ) -> HostState:
        """The host form of the rule (plain steps: no device op)."""
        assert self._host_values is not None and self.host is not None  # noqa: S101
        measured, underflow = self._host_values
        window, memory = self.host["window"], self.host["memory"]
        new, entry = _predictive.next_host_state(
            policy, before, after, window, memory, found, measured
        )
        self.telemetry = self._telemetry(
            policy,
            grad_max_abs=math.nan if found else entry if measured > 0 else 0.0,
            largest=max(window.max, memory.max),
            underflow=underflow - 1.0 if underflow > 0 else self.telemetry.underflow_fraction,
        )
        self._end()
        return new

    @staticmethod
    def _telemetry(
        policy: ScalePolicy | None, *, grad_max_abs: float, largest: float, underflow: float
    ) -> Telemetry:
        target = math.nan
        if policy is not None and largest > 0:
            target = _predictive.target_scale(policy, max(largest, _predictive.FLOOR))
        return Telemetry(grad_max_abs, largest, target, underflow)

    def is_lean(self, policy: ScalePolicy) -> bool:
        """Whether the device update runs without the dynamic rule (``_predictive.is_lean``)."""
        return _predictive.is_lean(policy)

    def _views(self, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the floor and both rings, the window, the memory) in the device tail."""
        rings = tail[TAIL_RINGS:]
        memory = self.lengths["memory"]
        return tail[TAIL_FLOOR:], rings[memory:], rings[:memory]

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
        self.loaded = False
        self._to_device(tail)
        self._tail = tail
        budget = self._budget
        if budget is None or budget.device != tail.device:
            budget = self._budget = torch.full((), _predictive.BUDGET, device=tail.device)
        rings, window, memory = self._views(tail)
        pos = (self.pos["window"], self.pos["memory"])
        asked = tail[TAIL_ASKED]
        if torch.compiler.is_compiling():
            # The rings turn under their positions instead (no per-step Python number in the
            # traced region): the same entries in the same ring order, from the same slot on.
            _predictive.traced_update_(
                policy, rings, window, memory, pos, scale, before, found_inf, measured, budget
            )
            torch.threshold(measured, 0.0, _predictive.BUDGET, out=asked)
            sampled = self.measure.sampling_flag(tail.device)
            tail[TAIL_UNDERFLOW].copy_(torch.where(sampled, underflow, tail[TAIL_UNDERFLOW]))
            self.turned = True  # counted by settle(), eagerly
            self._end()
            return
        self.settle()
        _predictive.update_(
            policy, rings, window, memory, pos, scale, before, found_inf, measured, budget, asked
        )
        self.pos = {name: (self.pos[name] + 1) % n for name, n in self.lengths.items()}
        if self.measure.sampling:  # the only steps whose vector carries a share
            tail[TAIL_UNDERFLOW].copy_(underflow)
        self._end()

    def _to_device_at(self, tail: torch.Tensor, pos: dict[str, int]) -> None:
        """:meth:`_to_device`, keeping the device positions ``pos`` (the host rings are at them)."""
        self._to_device(tail)
        self.pos = pos

    def _to_device(self, tail: torch.Tensor) -> None:
        """Hand the rings to the device buffer (once, after plain steps; no host sync)."""
        host = self.host
        if host is None:
            return
        underflow = self.telemetry.underflow_fraction
        values = [0.0 if math.isnan(underflow) else underflow + 1.0, 0.0, _predictive.FLOOR]
        values += host["memory"].slots + host["window"].slots
        # non_blocking: a blocking host-to-device copy waits for the GPU (a sync on CUDA).
        tail.copy_(torch.tensor(values, dtype=torch.float32).to(tail.device, non_blocking=True))
        self.pos = {name: ring.pos for name, ring in host.items()}
        self.shift = dict.fromkeys(self.lengths, 0)
        self.host = None

    def to_device_form(self, tail: torch.Tensor) -> None:
        """The rings in the device tail, and the sampling phase made (``_compiled.track``)."""
        self._to_device(tail)
        self._tail = tail
        if self._budget is None or self._budget.device != tail.device:
            self._budget = torch.full((), _predictive.BUDGET, device=tail.device)
        self.measure.settle()
        self.measure.sampling_flag(tail.device)

    def static_tensors(self) -> list[torch.Tensor]:
        """The device tensors a compiled update reads and writes (``_compiled.mark_static``)."""
        kept = (self._budget, self.measure._phase)
        return [t for t in kept if t is not None]

    def settle(self) -> None:
        """Count a compiled update's turn of the rings (an eager call after it)."""
        self.measure.settle()
        if self.turned:
            self.turned = False
            self.shift = {name: (self.shift[name] + 1) % n for name, n in self.lengths.items()}

    def _end(self) -> None:
        self._host_values = self._device_values = None
        self.measure.next_iteration()

    def skip_iteration(self) -> None:
        """update(new_scale=...): no rule ran, but the iteration is over."""
        self._end()

    # ------------------------------------------------------------ reading it back
    def rings(self) -> dict[str, Ring]:
        """Both rings in ring order with their positions; waits for the GPU after device updates."""
        if self.host is not None:
            return {name: (list(r.slots), r.pos) for name, r in self.host.items()}
        assert self._tail is not None  # noqa: S101 - host None only after a device update
        self.settle()
        _, window, memory = self._views(self._tail)
        found = {"window": window.tolist(), "memory": memory.tolist()}
        # As eager updates leave them: the same ring, its positions turned by `shift`.
        return {name: _turned(found[name], self.pos[name], self.shift[name]) for name in found}

    def telemetry_from(
        self, words: torch.Tensor | None, rows: int, pos: Any, policy: ScalePolicy | None
    ) -> Telemetry:
        """Telemetry from a host copy of the scale state's buffer (after device updates).

        What the last step measured comes from the buffer alone: its window entry, its ask and
        the overflow run in the counters, which a fold of the log keeps and a scale set since
        (``update(new_scale=...)``, which runs no rule) leaves as they were.
        """
        if self.host is not None or self.loaded or words is None or policy is None:
            return self.telemetry
        tail = words[_device_state.WORDS :]
        rings, window, _ = self._views(tail)
        window_pos = self.pos["window"] if pos is None else pos
        newest = float(window[(window_pos - 1) % self.lengths["window"]])
        state = _device_state.fold_on_host(words, rows, policy)
        overflowed = state.counters[SKIPPED_IN_A_ROW] > 0
        if float(tail[TAIL_ASKED]) == _predictive.BUDGET:
            # The hold entry of a step that measured nothing. (A measurement of exactly BUDGET
            # in scaled units reads as nothing too: the ask cannot tell the two apart.)
            newest = 0.0
        share = float(tail[TAIL_UNDERFLOW])
        return self._telemetry(
            policy,
            grad_max_abs=math.nan if overflowed else newest,
            largest=float(rings.max()),
            underflow=share - 1.0 if share > 0 else math.nan,
        )

    # ------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """The keys this policy adds (see the module docstring)."""
        state: dict[str, Any] = {"dscale_format_version": FORMAT_VERSION, "policy": "predictive"}
        for name, (slots, pos) in self.rings().items():
            state[f"predictive_{name}"] = slots
            state[f"_predictive_{name}_pos"] = pos
        return state

    def load(self, loaded: dict[str, Ring] | None) -> None:
        """Replace the rings (``from_state_dict``'s result); None empties them and says so.

        Rings kept on the device stay there, at their positions (written eagerly, turned to
        them; `shift` keeps the loaded positions for the saved form), so that a compiled update
        after the load runs the graph it was traced with.
        """
        if loaded is None:
            logger.warning(
                "the loaded GradScaler state dict has no predictive window (saved by torch, by "
                "a policy='dynamic' scaler or by dscale before format version %d): the window "
                "starts empty; the next clean step sets the scale from the measured gradients",
                FORMAT_VERSION,
            )
            loaded = {name: ([0.0] * n, 0) for name, n in self.lengths.items()}
        host = {}
        for name, n in self.lengths.items():
            ring = loaded[name]
            if len(ring[0]) != n:
                logger.warning(
                    "the loaded predictive_%s has %d entries, this scaler's has %d: kept the "
                    "newest %d",
                    name,
                    len(ring[0]),
                    n,
                    min(len(ring[0]), n),
                )
                ring = _resized(ring, n)
            host[name] = Window(list(ring[0]), ring[1])
        largest = max(ring.max for ring in host.values())
        self.telemetry = Telemetry(window_max=largest)
        self.turned = False
        if self.host is None and self._tail is not None:
            self.host = {
                name: Window(*_turned(ring.slots, ring.pos, (self.pos[name] - ring.pos)))
                for name, ring in host.items()
            }
            self._to_device_at(self._tail, dict(self.pos))
            self.loaded = True
            self.shift = {
                name: (ring.pos - self.pos[name]) % n
                for (name, ring), n in zip(host.items(), self.lengths.values(), strict=True)
            }
            return
        self.host = host
        self.pos = {name: ring.pos for name, ring in host.items()}
        self.shift = dict.fromkeys(self.lengths, 0)

    def note_interval(self, growth_interval: int) -> None:
        """Say so when a loaded growth_interval differs from the overflow memory's length.

        The memory lives in the device buffer sized at construction: it keeps its length.
        """
        if growth_interval != self.lengths["memory"]:
            logger.warning(
                "the loaded growth_interval=%d differs from the one this predictive GradScaler "
                "was built with (%d): overflows stay remembered for %d steps; build the scaler "
                "with growth_interval=%d to remember them for as long",
                growth_interval,
                self.lengths["memory"],
                self.lengths["memory"],
                growth_interval,
            )

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
        underflow = self.telemetry.underflow_fraction
        if self.host is None and self._tail is not None:
            share = float(self._tail[TAIL_UNDERFLOW])
            underflow = share - 1.0 if share > 0 else math.nan
        fresh = PredictiveScaling(self.lengths["window"], self.lengths["memory"])
        fresh.load(self.rings())
        fresh.telemetry = Telemetry(
            window_max=fresh.telemetry.window_max, underflow_fraction=underflow
        )
        fresh.measure.iteration = self.measure.iteration
        fresh.measure.sample_every = self.measure.sample_every
        return fresh.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("shift", dict.fromkeys(state["lengths"], 0))
        state.setdefault("turned", False)
        state.setdefault("loaded", False)
        self.__dict__.update(state)
