"""The spike gate: skip a step whose loss or grad norm is far above a window of recent steps.

The rule is OLMo-core's and Levanter's (``SkipStepOptimizer``, ``SkipStepConfig``): a step is
skipped when a watched value is more than ``sigma`` standard deviations above the mean of the
last ``window`` values, once the window holds ``warmup`` values. Differences, each on purpose:

- One-sided, as Levanter: a value far *below* the mean is not skipped (OLMo-core tests ``|z|``,
  so a sudden drop in the loss skips too).
- Only applied steps enter the window (OLMo-core and Levanter let every value in): a spike that
  was skipped does not widen the band for the next ``window`` steps, so a second spike right
  after the first is caught too. The price: after a lasting jump of the level, every step is
  skipped until someone acts; ``spike_skipped_in_a_row`` counts such a run, the scaler warns
  after ``stuck_patience`` of them and the alert ``DScaleSpikeSkipsInARow`` fires.
- The standard deviation is the sample one (n - 1), as ``torch.std`` in OLMo-core; the warm-up
  counts the values already in the window, as Levanter (OLMo-core counts the current one too).

Where the values come from: each rank puts its loss (what it passed to ``scale()`` this
iteration) and the squared L2 norm of the grads it holds into its own slot of the agreement
vector; the other ranks' slots hold -inf, so the MAX all-reduce hands every rank every rank's
values, in the same collective as the overflow flag. The step's loss is then the mean over the
ranks (OLMo-core all-reduces the loss the same way) and its grad norm the square root of the
sum of the squared norms: the global norm when the ranks hold shards (FSDP); with replicated
grads (DDP) it is sqrt(world size) times the norm, a constant factor that leaves every decision
unchanged (the z-score does not depend on the unit). Every rank reduces the same numbers in the
same order, so every rank decides alike. The vector grows by one float per rank and watched
value; nothing here grows with the parameter count.

The window and the counters stay on the device (float64 tensors): no host sync. Every step is a
handful of vector ops, whatever the window's length: the window is a shift register whose newest
value sits in its last column, with a row of ones beside the values (``1`` where a slot holds a
value), so one sum gives every signal's total and the count, one ``addcmul`` the deviations from
the mean (0 in empty slots), one norm their root sum of squares; the threshold factor
``sigma / sqrt(n - 1)`` (inf before the warm-up) is looked up in a table made once. An applied
step shifts its values in with one ``cat`` and one ``where``. The counters and the last values sit
in one packed float64 vector, published as it is. The state dict keeps the ring layout (slot
``i % spike_window`` for the i-th value; a roll on the host converts).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

#: The values the gate can watch, in their order in the agreement vector and the window.
SIGNALS = ("loss", "grad_norm")
#: The packed vector: values that entered the window, spike skips, in a row; then this step's
#: values and a 1 (the column push() shifts into the window; the last values once pushed).
ENTERED, SKIPPED, IN_A_ROW = range(3)
LAST = 3

STATE_KEYS = (
    "spike_signals",
    "spike_window_values",
    "spike_window_entered",
    "num_spike_skipped_steps",
    "num_spike_skipped_in_a_row",
)


def check_spike_args(signals: Any, sigma: Any, window: Any, warmup: Any) -> tuple[str, ...]:
    """Raise ValueError naming the first bad spike-gate argument; return the signals in order."""
    if isinstance(signals, str) or not isinstance(signals, Sequence):
        raise ValueError(
            f"spike_signals must be a list or tuple drawn from {SIGNALS}, got {signals!r}; "
            'for example spike_signals=("loss", "grad_norm") (empty: the spike gate is off)'
        )
    unknown = [s for s in signals if s not in SIGNALS]
    if unknown:
        raise ValueError(
            f"spike_signals has {unknown}, not among {SIGNALS}; pick from those two "
            "(empty: the spike gate is off)"
        )
    if (
        isinstance(sigma, bool)
        or not isinstance(sigma, (int, float))
        or not (math.isfinite(sigma) and sigma > 0)
    ):
        raise ValueError(
            f"spike_sigma must be a finite number > 0, got {sigma!r}; a step is skipped when a "
            "watched value is more than this many standard deviations above the window's mean "
            "(OLMo-core and Levanter use 6)"
        )
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(
            f"spike_window must be an int >= 2, got {window!r}; it is how many recent applied "
            "steps the mean and standard deviation are taken over (default 128)"
        )
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 2 <= warmup <= window:
        raise ValueError(
            f"spike_warmup must be an int in [2, spike_window={window}], got {warmup!r}; no step "
            "is skipped for a spike before the window holds this many values (default 64)"
        )
    return tuple(s for s in SIGNALS if s in signals)


class SpikeGate:
    """One scaler's spike gate: this iteration's local values, the window, the decision."""

    def __init__(self, signals: tuple[str, ...], *, sigma: float, window: int, warmup: int) -> None:
        self.signals = signals
        self.sigma = float(sigma)
        self.window = window
        self.warmup = warmup
        self.watches_loss = "loss" in signals
        self.watches_grad_norm = "grad_norm" in signals
        self._loss: torch.Tensor | None = None  # this iteration's loss on this rank (a sum)
        self._device: torch.device | None = None
        # float64 [len(signals) + 1, window]: a shift register (newest value in the last column)
        # over a row of ones where a slot holds a value; empty slots are 0 in every row.
        self.window_rows: torch.Tensor | None = None
        # float64 [ENTERED, SKIPPED, IN_A_ROW, last values...]: counters and the last step's values.
        self.packed: torch.Tensor | None = None
        self._factor: torch.Tensor | None = (
            None  # [window + 1]: sigma / sqrt(n - 1), inf if n < warmup
        )
        self._slots: tuple[Any, torch.Tensor] | None = None  # ((device, rank, world), slots)
        self._zeros = torch.zeros(len(signals), dtype=torch.float64)
        self._host: dict[str, float | int] = self._fresh_host()
        self._in_flight: tuple[torch.Tensor, Any | None] | None = None
        self._pending_load: dict[str, Any] | None = None

    # ------------------------------------------------------------------ local values
    def add_loss(self, outputs: Any) -> None:
        """Add what was passed to ``scale()`` to this iteration's loss (detached; no sync).

        A 0-d fp32 loss is kept as it is, not copied (one op less per step): the gate reads it
        at ``step()``, so a loss changed in place in between is read changed.
        """
        if not self.watches_loss:
            return
        for tensor in tensors_in(outputs):
            value = tensor.detach()
            if value.dim() or value.dtype != torch.float32:  # a 0-d fp32 loss is its own sum
                value = value.float().sum()
            self._loss = value if self._loss is None else self._loss + value.to(self._loss.device)

    def tail(
        self,
        grads: Sequence[torch.Tensor],
        carried: torch.Tensor | None,
        device: torch.device,
        rank: int,
        world: int,
    ) -> torch.Tensor:
        """This rank's part of the agreement vector: ``len(signals) x world`` slots, -inf but ours.

        ``grads`` are every grad this rank holds for the optimizer, carrying the factor
        ``carried`` (the scale while still scaled; None when unscaled).
        """
        if self.watches_loss and self._loss is None:
            raise RuntimeError(
                "the spike gate watches the loss, but no loss was passed to scale() in this "
                "iteration: call scaler.scale(loss).backward() (a StepGuard returns the loss "
                'unchanged), or drop "loss" from spike_signals'
            )
        key = (device, rank, world)
        if self._slots is None or self._slots[0] != key:
            # The other ranks' slots stay -inf for good; the scaler's cat copies the vector.
            blank = torch.full((len(self.signals), world), -math.inf, device=device)
            self._slots = (key, blank)
        slots = self._slots[1]
        mine = slots[:, rank]
        local = []  # this rank's values, rounded to fp32 as they are written
        if self._loss is not None:  # watched (add_loss keeps none otherwise)
            local.append(self._loss.to(device))
        if self.watches_grad_norm:
            local.append(_squared_norm(grads, carried, device))
        torch.stack(local, out=mine)
        # MAX must be well defined: a NaN would vanish or not depending on the order.
        torch.nan_to_num_(mine, nan=math.inf, posinf=math.inf, neginf=-math.inf)
        return slots.reshape(-1)

    # ------------------------------------------------------------------ decision
    def _place(self, device: torch.device) -> None:
        if self._device == device:
            return
        n = len(self.signals)
        if self.window_rows is None:
            self.window_rows = torch.zeros(n + 1, self.window, dtype=torch.float64, device=device)
            self.packed = torch.zeros(LAST + n + 1, dtype=torch.float64, device=device)
            self.packed[LAST:-1] = math.nan
            self.packed[-1] = 1.0
            if self._pending_load is not None:
                self._write(self._pending_load)
                self._pending_load = None
        else:
            assert self.packed is not None  # noqa: S101
            self.window_rows = self.window_rows.to(device)
            self.packed = self.packed.to(device)
        counts = torch.arange(self.window + 1, dtype=torch.float64)
        factor = self.sigma / (counts - 1).clamp(min=1).sqrt()
        self._factor = factor.masked_fill(counts < self.warmup, math.inf).to(device)
        self._zeros = torch.zeros(n, dtype=torch.float64, device=device)
        self._device = device

    @property
    def counts(self) -> torch.Tensor | None:
        """[ENTERED, SKIPPED, IN_A_ROW] on the device (float64, exact), once placed."""
        return None if self.packed is None else self.packed[:LAST]

    def decide(
        self, tail: torch.Tensor, overflow: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(spike, values) from the agreed tail: spike is 0-d fp32 (0 or 1), values float64.

        ``overflow`` is the agreed overflow flag (0 or 1): an overflowing step is an overflow,
        not a spike, so it is never counted twice.
        """
        self._place(tail.device)
        assert self.window_rows is not None and self._factor is not None  # noqa: S101
        n = len(self.signals)
        world = tail.numel() // n
        # The loss is the mean over ranks, the grad norm the root of the summed squares; written
        # into the packed column that push() shifts in (its last entry is the ones row's 1).
        assert self.packed is not None  # noqa: S101
        column = self.packed[LAST:]
        values = torch.sum(tail.view(n, world), 1, dtype=torch.float64, out=column[:n])
        if self.watches_loss and world > 1:
            values[:1].div_(world)
        if self.watches_grad_norm:
            values[n - 1 :].sqrt_()
        rows = self.window_rows
        sums = rows.sum(1)  # every signal's total, and the count of values
        mean = sums[:n] / sums[n]  # NaN when empty: no threshold, no spike
        deviations = torch.addcmul(rows[:n], mean[:, None], rows[n], value=-1.0)
        threshold = torch.addcmul(
            mean,
            self._factor.take(sums[n:].long()),  # inf before the warm-up: no spike
            torch.linalg.vector_norm(deviations, dim=1),
        )
        above = (values > threshold).any()
        # A spike where no overflow (the flag is 0 or 1): as fp32, the flag's type.
        spike = torch.empty((), dtype=torch.float32, device=tail.device)
        return torch.gt(above, overflow.reshape(()), out=spike), values

    def push(self, values: torch.Tensor, spike: torch.Tensor, skip: torch.Tensor) -> None:
        """End of an iteration: an applied step's (finite) values enter the window; count.

        ``values`` and ``spike`` are :meth:`decide`'s; ``skip`` the step's skip flag (0 or 1).
        """
        assert self.window_rows is not None and self.packed is not None  # noqa: S101
        rows = self.window_rows
        # Applied (skip == 0) and finite: a dot with zeros is 0, or NaN for an inf or NaN.
        enters = torch.eq(torch.dot(values, self._zeros), skip.reshape(()))
        shifted = torch.cat([rows[:, 1:], self.packed[LAST:, None]], 1)
        torch.where(enters, shifted, rows, out=rows)
        spike = spike.reshape(())
        # Entering and a spike exclude each other: a spike skips the step.
        self.packed[:LAST].add_(torch.stack([enters, spike, spike]))
        self.packed[IN_A_ROW : IN_A_ROW + 1].masked_fill_(enters, 0.0)
        self._publish()  # with the step's values, which decide() wrote into the packed vector

    def end_iteration(self) -> None:
        """Forget this iteration's loss (update() calls it, whatever happened)."""
        self._loss = None

    # ------------------------------------------------------------------ reading
    def _fresh_host(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {
            "spike_skipped_steps": 0,
            "spike_skipped_in_a_row": 0,
            "spike_window_values": 0,
        }
        for name in self.signals:
            out[f"spike_{name}"] = math.nan
        return out

    def _publish(self) -> None:
        """Start a copy of the counters and last values to the host (non-blocking on CUDA)."""
        assert self.packed is not None  # noqa: S101
        row = self.packed
        if row.device.type != "cuda":  # read when asked: the latest values, as published
            self._in_flight = (row, None)
            return
        buffer = torch.empty(row.shape, dtype=row.dtype, pin_memory=True)
        buffer.copy_(row, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._in_flight = (buffer, event)

    def _host_from(self, row: list[float]) -> dict[str, float | int]:
        entered, skipped, in_a_row, *last = row
        out: dict[str, float | int] = {
            "spike_skipped_steps": int(skipped),
            "spike_skipped_in_a_row": int(in_a_row),
            "spike_window_values": int(min(entered, self.window)),
        }
        for name, value in zip(self.signals, last[: len(self.signals)], strict=True):
            out[f"spike_{name}"] = value
        return out

    def snapshot(self, *, wait: bool = True) -> dict[str, float | int]:
        """Counters and the last step's values as Python numbers (see GradScaler.snapshot)."""
        in_flight = self._in_flight
        if in_flight is not None:
            row, event = in_flight
            if event is None or wait or event.query():
                if event is not None and wait:
                    event.synchronize()
                self._host = self._host_from(row.tolist())
        return dict(self._host)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The window and counters (waits for the device after device-side steps)."""
        if self.window_rows is None:
            if self._pending_load is not None:
                return dict(self._pending_load)
            values = torch.zeros(len(self.signals), self.window, dtype=torch.float64)
            counts = [0, 0, 0]
        else:
            assert self.packed is not None  # noqa: S101
            counts = [int(c) for c in self.packed[:LAST].tolist()]
            # The i-th value that entered lives in slot i % window of the saved ring.
            shift = counts[ENTERED] % self.window
            values = self.window_rows[:-1].detach().cpu().roll(shift, dims=1).clone()
        return {
            "spike_signals": ",".join(self.signals),
            "spike_window_values": values,
            "spike_window_entered": counts[ENTERED],
            "num_spike_skipped_steps": counts[SKIPPED],
            "num_spike_skipped_in_a_row": counts[IN_A_ROW],
        }

    def check_state(self, state: Mapping[str, Any]) -> dict[str, Any] | None:
        """Validate the spike keys of a state dict; None when it has none (a fresh window)."""
        if "spike_window_values" not in state:
            return None
        signals = state.get("spike_signals", ",".join(self.signals))
        if signals != ",".join(self.signals):
            raise ValueError(
                f"state_dict: spike_signals={signals!r} but this scaler watches "
                f"{','.join(self.signals)!r}; its window holds other values. Construct the scaler "
                "with the same spike_signals, or drop the spike_* keys to start a fresh window"
            )
        values = state["spike_window_values"]
        if not isinstance(values, torch.Tensor):
            values = torch.as_tensor(values, dtype=torch.float64)
        expected = (len(self.signals), self.window)
        if tuple(values.shape) != expected:
            raise ValueError(
                f"state_dict: spike_window_values has shape {tuple(values.shape)}, expected "
                f"{expected} (spike_window={self.window}); load it with the spike_window it was "
                "saved with, or drop the spike_* keys to start a fresh window"
            )
        out = {"spike_signals": signals, "spike_window_values": values.double().cpu()}
        for key in (
            "spike_window_entered",
            "num_spike_skipped_steps",
            "num_spike_skipped_in_a_row",
        ):
            value = state.get(key, 0)
            if isinstance(value, torch.Tensor):
                value = int(value.item())
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"state_dict: {key} must be an int >= 0, got {value!r}")
            out[key] = value
        return out

    def load(self, checked: dict[str, Any] | None) -> None:
        """Replace the window and counters with a dict from :meth:`check_state` (None: fresh)."""
        if checked is None:
            checked = {
                "spike_window_values": torch.zeros(len(self.signals), self.window),
                "spike_window_entered": 0,
                "num_spike_skipped_steps": 0,
                "num_spike_skipped_in_a_row": 0,
            }
        if self.window_rows is None:
            self._pending_load = checked
            self._host = self._host_from(_row(checked, len(self.signals)))
            return
        self._write(checked)

    def _write(self, checked: Mapping[str, Any]) -> None:
        assert self.window_rows is not None and self.packed is not None  # noqa: S101
        entered = checked["spike_window_entered"]
        ring = checked["spike_window_values"].to(torch.float64).cpu()
        filled = min(entered, self.window)
        rows = torch.zeros(len(self.signals) + 1, self.window, dtype=torch.float64)
        rows[:-1] = ring.roll(-(entered % self.window), dims=1)  # oldest first, newest last
        rows[-1, self.window - filled :] = 1.0
        rows[:-1] *= rows[-1]  # a slot past the values saved is empty, whatever it held
        self.window_rows.copy_(rows)
        counts = [
            entered,
            checked["num_spike_skipped_steps"],
            checked["num_spike_skipped_in_a_row"],
        ]
        self.packed[:LAST].copy_(torch.tensor(counts, dtype=torch.float64))
        self.packed[LAST:-1] = math.nan
        self._host = self._host_from(_row(checked, len(self.signals)))
        self._in_flight = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self.window_rows is not None:  # tensors go through the state dict, as the scale does
            state["_pending_load"] = self.state_dict()
        for name in (
            "window_rows",
            "packed",
            "_factor",
            "_slots",
            "_device",
            "_loss",
            "_in_flight",
        ):
            state[name] = None
        return state


def _row(checked: Mapping[str, Any], n: int) -> list[float]:
    return [
        float(checked["spike_window_entered"]),
        float(checked["num_spike_skipped_steps"]),
        float(checked["num_spike_skipped_in_a_row"]),
        *([math.nan] * n),
    ]


def tensors_in(outputs: Any) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (list, tuple)):
        return [t for item in outputs for t in tensors_in(item)]
    return []


def _squared_norm(
    grads: Sequence[torch.Tensor], carried: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """Sum of squares of ``grads`` / carried^2, in float64 on ``device``: one fused norm per group.

    fp32 accumulation inside the norm, as torch's clip_grad_norm_ (an fp16 grad near 65504 would
    overflow an fp16 norm).
    """
    total: torch.Tensor | None = None
    if grads:
        grouped = torch._C._group_tensors_by_device_and_dtype([list(grads)], False)
        for lists, _ in grouped.values():
            norms = torch._foreach_norm(lists[0], 2, dtype=torch.float32)  # type: ignore[arg-type]
            squares = torch.empty(len(norms), dtype=torch.float64, device=norms[0].device)
            part = torch.stack(norms, out=squares).square_().sum()  # in fp64, as stacked
            total = part if total is None else total + part.to(device)
    if total is None:
        total = torch.zeros((), dtype=torch.float64, device=device)
    if carried is None:  # the grads are unscaled: the sum as it is
        return total.to(device)
    factor = carried.to(device).double().reshape(())
    return total.to(device) / factor.square()
