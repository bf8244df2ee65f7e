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
sum of the squared norms, each DTensor grad's weighted by 1 / (ranks holding a copy of it)
(``placements``): the global norm on every mesh (FSDP2, TP, sequence parallel, HSDP, 2-D); with
plain replicated grads (DDP) it is sqrt(world size) times the norm, a constant factor that leaves
every decision unchanged (the z-score does not depend on the unit). Every rank reduces the same
numbers in the same order, so every rank decides alike. The vector grows by one float per rank
and watched value; nothing here grows with the parameter count.

The window and the counters stay on the device (float64 tensors): no host sync. Every step is a
handful of vector ops, whatever the window's length. One float64 matrix holds everything, a shift
register whose newest value sits in column ``window - 1``, with this step's column (``window``)
beside it, twice (``window`` and ``window + 1``, so that the shifted matrix carries it too):

- one row per watched value, then a row of ones (``1`` where a slot holds a value), so one sum
  gives every signal's total and the count, one ``addcmul`` the deviations from the mean (0 in
  empty slots), one norm their root sum of squares;
- a row of threshold factors ``sigma / sqrt(n - 1)`` (inf before the warm-up) for the counts
  that the next values will bring, shifted with the values: its first slot is the factor for
  the count now, so no lookup is needed;
- a row whose slot ``window - 1`` holds the spike skips counted at the last value that entered,
  and whose column-``window`` slot holds the spike skips: the shift that enters a value copies
  the count there, so spike skips "in a row" are their difference, and no op resets a counter;
- the values that entered, in column ``window`` of the last row.

Two such matrices take turns: an applied step's ``where`` writes the other one shifted, a skipped
step's writes it as it is, and one add counts the spike and the entry, both written into one
pair of bools by the ops that decide them. The state dict keeps the ring layout (slot
``i % spike_window`` for the i-th value; a roll on the host converts).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dscale.scaler._program import unscale as _unscale
from dscale.scaler._state import spike as _spike_state
from dscale.scaler._state.spike import ENTRIES, FACTORS, ONES, SPIKES

#: The values the gate can watch, in their order in the agreement vector and the window.
SIGNALS = ("loss", "grad_norm")
#: The counters as :attr:`SpikeGate.counts` gives them: values that entered the window, spike
#: skips, spike skips in a row.
ENTERED, SKIPPED, IN_A_ROW = range(3)

STATE_KEYS = _spike_state.STATE_KEYS


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
        # Pipeline schedules (GradScaler.pipeline_loss): a rank may hold no loss (its slot says
        # -inf, and the step's loss is the mean over the ranks that hold one), and the
        # microbatch losses the schedule computed are combined by `microbatch_reduction`.
        self.pipelined = False
        self.microbatch_reduction = "mean"
        self._microbatch_sum: torch.Tensor | None = None
        self._microbatches = 0
        self._device: torch.device | None = None
        # float64 [len(signals) + 4, window + 2], rows as the module docstring says: values,
        # ones, factors, spike skips (at the last entry | now), entries (column `window` on);
        # the matrix now and the one the next push() writes, in turn.
        self.state: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None
        self._flags: torch.Tensor | None = None  # bool [spike, enters] of this step
        self._slots: tuple[Any, torch.Tensor] | None = None  # ((device, rank, world), slots)
        self._norms: tuple[Any, torch.Tensor] | None = None  # ((device, count), buffer)
        # (roots as given, the stacked order, the roots in that order): made once per pair
        self._roots: tuple[torch.Tensor, tuple[int, ...], torch.Tensor] | None = None
        self._zeros = torch.zeros(len(signals), dtype=torch.float64)
        self._consts: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._host: dict[str, float | int] = self._fresh_host()
        self._in_flight: tuple[torch.Tensor, Any | None] | None = None
        self._pending_load: dict[str, Any] | None = None
        self._publish_due = False  # a compiled push() left the host copy to publish_if_due()

    # ------------------------------------------------------------------ layout
    @property
    def _spikes(self) -> int:
        return len(self.signals) + SPIKES

    @property
    def _entries(self) -> int:
        return len(self.signals) + ENTRIES

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(fp64 inf, fp32 inf, fp32 zero) on ``device``: operands made once."""
        if device not in self._consts:
            self._consts[device] = (
                torch.full((), math.inf, dtype=torch.float64, device=device),
                torch.full((), math.inf, device=device),
                torch.zeros((), device=device),
            )
        return self._consts[device]

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

    def add_microbatch_loss(self, loss: torch.Tensor) -> None:
        """Add one microbatch's loss, as a pipeline schedule computed it (detached; no sync)."""
        if not self.watches_loss:
            return
        value = loss.detach()
        if value.dim() or value.dtype != torch.float32:
            value = value.float().sum()
        total = self._microbatch_sum
        self._microbatch_sum = value if total is None else total + value.to(total.device)
        self._microbatches += 1

    def _step_loss(self, device: torch.device) -> torch.Tensor | None:
        """This rank's loss for the step: scale()'s sum plus the microbatches' mean (or sum)."""
        loss = self._loss
        total = self._microbatch_sum
        if total is not None:
            if self.microbatch_reduction == "mean" and self._microbatches > 1:
                total = total / self._microbatches
            loss = total if loss is None else loss + total.to(loss.device)
        if loss is None and self.pipelined:  # a stage without the loss: no value, -inf
            return torch.full((), -math.inf, device=device)
        return None if loss is None else loss.to(device)

    def tail(
        self,
        grads: Sequence[torch.Tensor],
        carried: torch.Tensor | None,
        device: torch.device,
        rank: int,
        world: int,
        roots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's part of the agreement vector: ``len(signals) x world`` slots, -inf but ours.

        ``grads`` are every grad this rank holds for the optimizer, carrying the factor
        ``carried`` (the scale while still scaled; None when unscaled). Ours hold the loss and
        the squared grad norm rounded to fp32, a NaN made +inf: MAX must be well defined, and a
        NaN would vanish or not depending on the order. ``roots`` (float64, one per grad, in
        ``grads``' order; None: all 1) scale each grad's norm before it is squared, so that a
        grad held whole by several ranks counts once in the sum over the ranks.
        """
        loss = self._step_loss(device) if self.watches_loss else None
        if self.watches_loss and loss is None:
            raise RuntimeError(
                "the spike gate watches the loss, but no loss was passed to scale() in this "
                "iteration: call scaler.scale(loss).backward() (a StepGuard returns the loss "
                'unchanged), or drop "loss" from spike_signals. A pipeline stage that holds '
                "no loss: build every stage's schedule with "
                "loss_fn=scaler.pipeline_loss(loss_fn)"
            )
        key = (device, rank, world)
        if self._slots is None or self._slots[0] != key:
            # The other ranks' slots stay -inf for good; the scaler's cat copies the vector.
            blank = torch.full((len(self.signals), world), -math.inf, device=device)
            self._slots = (key, blank)
        slots = self._slots[1]
        mine = slots[:, rank]
        inf64, inf32, zero = self._constants(device)
        loss = zero if loss is None else loss
        if not self.watches_grad_norm:  # the loss alone: NaN -> inf as it is written
            _out(torch.fmin, loss.reshape(1), inf32, out=mine)
            return slots.reshape(-1)
        local = self._local_values(loss, grads, device, roots)  # float64 [loss, squared norm]
        if carried is not None:  # the grads are still scaled: divide the sum by scale^2
            local[1:].div_(carried.to(device).double().reshape(()).square())
        # fmin(x, inf) is x, and inf for a NaN: the write rounds to fp32 and clears NaNs at once.
        _out(torch.fmin, local if self.watches_loss else local[1:], inf64, out=mine)
        return slots.reshape(-1)

    def _local_values(
        self,
        loss: torch.Tensor,
        grads: Sequence[torch.Tensor],
        device: torch.device,
        roots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[loss, sum of squared grad norms] in float64, by one fused norm per group and one mm.

        fp32 accumulation inside the norm, as torch's clip_grad_norm_ (an fp16 grad near 65504
        would overflow an fp16 norm). The k norms go, after the loss, into a buffer laid out as
        ``[0]*(k-1), 1, [0]*(k-1), loss, norms``, so that ``X = [[0.., loss], norms]`` and
        ``Y = [[0.., 1], norms]`` are two strided views of it and ``diag(X @ Y.T)`` is
        ``[loss, sum of squares]``: the stack's copy is the fp64 cast, one mm does the rest
        (exact for the loss, whatever it is; the fp64 sum may differ from a plain sum in its
        last bits, which the fp32 slot rounds away).
        """
        norms: list[torch.Tensor] = []
        parts: list[torch.Tensor] = []
        order: list[int] = []  # the grads' positions in the stacked norms (roots only)
        later: list[int] = []
        if grads:
            with_positions = roots is not None  # where each norm comes from, for its weight
            grouped = torch._C._group_tensors_by_device_and_dtype([list(grads)], with_positions)
            for lists, positions in grouped.values():
                found = _unscale.norms(lists[0], 2)  # type: ignore[arg-type]
                if found[0].device == device:
                    norms.extend(found)
                    order.extend(positions)
                else:  # a group on another device: one stacked copy of its norms
                    parts.append(torch.stack(list(found)).to(device))
                    later.extend(positions)
        count = len(norms) + sum(len(p) for p in parts)
        if count == 0:  # no grads: a norm of 0
            norms, count = [self._constants(device)[2]], 1
        key = (device, count)
        if self._norms is None or self._norms[0] != key:
            buffer = torch.zeros(3 * count, dtype=torch.float64, device=device)
            buffer[count - 1] = 1.0
            self._norms = (key, buffer)
        buffer = self._norms[1]
        written = buffer[2 * count - 1 :]
        if parts:
            torch.cat([loss.reshape(1), *(n.reshape(1) for n in norms), *parts], out=written)
        else:
            torch.stack([loss, *norms], out=written)
        if roots is not None and grads:  # each norm times sqrt(its weight), in stacked order
            written[1:].mul_(self._ordered(roots, order + later))
        x = buffer.as_strided((2, count), (count, 1), count)
        y = buffer.as_strided((2, count), (2 * count, 1), 0)
        return torch.mm(x, y.t()).diagonal()

    def _ordered(self, roots: torch.Tensor, order: list[int]) -> torch.Tensor:
        """``roots`` in the stacked norms' order, made once per (roots, order)."""
        key = tuple(order)
        known = self._roots
        if known is None or known[0] is not roots or known[1] != key:
            index = torch.tensor(order, dtype=torch.long, device=roots.device)
            self._roots = known = (roots, key, roots.index_select(0, index))
        return known[2]

    # ------------------------------------------------------------------ decision
    def _place(self, device: torch.device) -> None:
        if self._device == device:
            return
        if self.state is None or self._spare is None:
            shape = (len(self.signals) + 4, self.window + 2)
            self.state = torch.empty(shape, dtype=torch.float64, device=device)
            self._spare = torch.empty_like(self.state)
            self._write(self._pending_load or _spike_state.empty_state(self.signals, self.window))
            self._pending_load = None
        else:
            self.state = self.state.to(device)
            self._spare = self._spare.to(device)
        self._flags = torch.zeros(2, dtype=torch.bool, device=device)
        self._zeros = torch.zeros(len(self.signals), dtype=torch.float64, device=device)
        self._device = device

    def static_tensors(self) -> list[torch.Tensor]:
        """The gate's device tensors a compiled region reads or writes (``_compiled.mark_static``);
        not the loss (a new tensor each step)."""
        kept = [self.state, self._spare, self._flags, self._zeros]
        kept += [self._slots[1] if self._slots else None, self._norms[1] if self._norms else None]
        kept += [self._roots[2] if self._roots else None]
        kept += [c for consts in self._consts.values() for c in consts]
        return [t for t in kept if t is not None]

    @property
    def counts(self) -> torch.Tensor | None:
        """[ENTERED, SKIPPED, IN_A_ROW] on the device (float64, exact), once placed.

        A new tensor (two ops): the matrix keeps the spike skips at the last entry, not the run.
        """
        if self.state is None:
            return None
        column = self.state[:, self.window]
        skipped = column[self._spikes]
        at_entry = self.state[self._spikes, self.window - 1]
        return torch.stack([column[self._entries], skipped, skipped - at_entry])

    def decide(
        self, tail: torch.Tensor, overflow: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(spike, values, skip) from the agreed tail and overflow flag (0 or 1).

        spike is a 0-d bool, values float64, skip the flag the step obeys: 0-d fp32, 1 for an
        overflow or a spike (0 or 1 either way: fused kernels test ``found_inf == 1``). An
        overflowing step is an overflow, not a spike, so it is never counted twice. skip is
        written into the tail's last slot, read by then: a host read of the agreed vector brings
        it along.
        """
        self._place(tail.device)
        state, flags = self.state, self._flags
        assert state is not None and flags is not None  # noqa: S101
        n, w = len(self.signals), self.window
        world = tail.numel() // n
        # The loss is the mean over ranks, the grad norm the root of the summed squares; written
        # into this step's two columns, which push() shifts in.
        ranks = tail.view(n, 1, world).expand(n, 2, world)
        holders = self._loss_holders(tail, world) if self.pipelined else None
        pair = _out(torch.sum, ranks, 2, dtype=torch.float64, out=state[:n, w : w + 2])
        if holders is not None:
            pair[:1].div_(holders)
        elif self.watches_loss and world > 1:
            pair[:1].div_(world)
        if self.watches_grad_norm:
            pair[n - 1 :].sqrt_()
        values = state[:n, w]
        window = state[: n + ONES + 1, :w]  # the values and the ones row
        sums = window.sum(1)  # every signal's total, and the count of values
        mean = sums[:n] / sums[n]  # NaN when empty: no threshold, no spike
        deviations = torch.addcmul(window[:n], mean[:, None], window[n], value=-1.0)
        threshold = torch.addcmul(
            mean,
            state[n + FACTORS, :1],  # the factor for this count; inf before the warm-up
            torch.linalg.vector_norm(deviations, dim=1),
        )
        above = (values > threshold).any()
        overflow = overflow.reshape(())
        spike = _out(torch.gt, above, overflow, out=flags[0])  # a spike where no overflow
        return spike, values, _out(torch.maximum, overflow, spike, out=tail[-1])

    def _loss_holders(self, tail: torch.Tensor, world: int) -> torch.Tensor | None:
        """Pipelined: how many ranks sent a loss (float64), their -inf slots made 0 in place.

        A stage without the loss sends -inf (no value); the step's loss is the mean over the
        others (the ranks that hold the last stage, one per pipeline replica). 3 ops.
        """
        if not self.watches_loss:
            return None
        losses = tail[:world]  # the loss is the first signal: its row leads the tail
        holders = losses.gt(-math.inf).sum(dtype=torch.float64)
        losses.nan_to_num_(nan=math.inf, posinf=math.inf, neginf=0.0)
        return holders

    def push(self, values: torch.Tensor, spike: torch.Tensor, skip: torch.Tensor) -> None:
        """End of an iteration: an applied step's (finite) values enter the window; count.

        ``values``, ``spike`` and ``skip`` are :meth:`decide`'s (the count reads the spike
        where decide() wrote it, beside the flag written here).
        """
        state, spare, flags = self.state, self._spare, self._flags
        assert state is not None and spare is not None and flags is not None  # noqa: S101
        w = self.window
        # Applied (skip == 0) and finite: a dot with zeros is 0, or NaN for an inf or NaN.
        enters = _out(torch.eq, torch.dot(values, self._zeros), skip.reshape(()), out=flags[1])
        # Where a value enters every row moves left by one slot: the values, the ones, the
        # factors, and the spike skips into the "at the last entry" slot.
        _out(torch.where, enters, state[:, 1:], state[:, : w + 1], out=spare[:, : w + 1])
        # [spike skips, entries] + [spike, enters] into both step columns (a spike skips the
        # step, so never both); written from this matrix, whose counts the shift may not carry.
        counts = state[self._spikes : self._entries + 1, w + 1 :].expand(2, 2)
        _out(torch.add, counts, flags[:, None], out=spare[self._spikes : self._entries + 1, w:])
        if torch.compiler.is_compiling():
            # One matrix, at one address: a CUDA graph's static input (the swap below would move
            # which tensor sits at this input: a re-record per step). The same values, copied.
            state.copy_(spare)
            self._publish_due = True  # the host copy is left to the next eager call
            return
        self.state, self._spare = spare, state
        self._publish()  # with the step's values, which the shift carried into column `window`

    def end_iteration(self) -> None:
        """Forget this iteration's loss (update() calls it, whatever happened)."""
        self._loss = None
        self._microbatch_sum = None
        self._microbatches = 0

    # ------------------------------------------------------------------ reading
    def _fresh_host(self) -> dict[str, float | int]:
        return self._host_values(0, 0, 0, [math.nan] * len(self.signals))

    def _host_values(
        self, entered: float, skipped: float, in_a_row: float, last: Sequence[float]
    ) -> dict[str, float | int]:
        out: dict[str, float | int] = {
            "spike_skipped_steps": int(skipped),
            "spike_skipped_in_a_row": int(in_a_row),
            "spike_window_values": int(min(entered, self.window)),
        }
        for name, value in zip(self.signals, last, strict=True):
            out[f"spike_{name}"] = value
        return out

    def _published(self) -> torch.Tensor:
        """Columns ``window - 1`` and ``window``: the last values and every counter, one view."""
        assert self.state is not None  # noqa: S101
        return self.state[:, self.window - 1 : self.window + 1]

    def _publish(self) -> None:
        """Start a copy of the counters and last values to the host (non-blocking on CUDA)."""
        view = self._published()
        if view.device.type != "cuda":  # read when asked: the latest values, as published
            self._in_flight = (view, None)
            return
        buffer = torch.empty(view.shape, dtype=view.dtype, pin_memory=True)
        buffer.copy_(view, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._in_flight = (buffer, event)

    def publish_if_due(self) -> None:
        """Start the copy that compiled steps left (an eager call: scale())."""
        if self._publish_due:
            self._publish_due = False
            self._publish()

    def _host_from(self, rows: list[list[float]]) -> dict[str, float | int]:
        """The host numbers from a read of :meth:`_published` (one row per matrix row)."""
        n = len(self.signals)
        at_entry, skipped = rows[self._spikes]
        return self._host_values(
            rows[self._entries][1], skipped, skipped - at_entry, [row[1] for row in rows[:n]]
        )

    def snapshot(self, *, wait: bool = True) -> dict[str, float | int]:
        """Counters and the last step's values as Python numbers (see GradScaler.snapshot)."""
        if wait:  # the training thread: a copy that compiled steps left starts here
            self.publish_if_due()
        in_flight = self._in_flight
        if in_flight is not None:
            rows, event = in_flight
            if event is None or wait or event.query():
                if event is not None and wait:
                    event.synchronize()
                self._host = self._host_from(rows.tolist())
        return dict(self._host)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The window and counters (waits for the device after device-side steps)."""
        if self.state is None:
            return dict(self._pending_load or _spike_state.empty_state(self.signals, self.window))
        host = self._host_from(self._published().tolist())
        entered = int(self._published()[self._entries, 1].item())
        return {
            "spike_signals": ",".join(self.signals),
            "spike_window_values": _spike_state.to_ring(self.state, len(self.signals), entered),
            "spike_window_entered": entered,
            "num_spike_skipped_steps": int(host["spike_skipped_steps"]),
            "num_spike_skipped_in_a_row": int(host["spike_skipped_in_a_row"]),
        }

    def check_state(self, state: Mapping[str, Any]) -> dict[str, Any] | None:
        """Validate the spike keys of a state dict; None when it has none (a fresh window)."""
        return _spike_state.check_state(state, self.signals, self.window)

    def load(self, checked: dict[str, Any] | None) -> None:
        """Replace the window and counters with a dict from :meth:`check_state` (None: fresh)."""
        if checked is None:
            checked = _spike_state.empty_state(self.signals, self.window)
        if self.state is None:
            self._pending_load = checked
            counts = _spike_state.counters(checked)
            self._host = self._host_values(*counts, [math.nan] * len(self.signals))
            return
        self._write(checked)

    def _write(self, checked: Mapping[str, Any]) -> None:
        """Build the matrix for ``checked`` on the host and copy it into both matrices."""
        assert self.state is not None and self._spare is not None  # noqa: S101
        table = _spike_state.factor_table(self.sigma, self.window, self.warmup)
        rows = _spike_state.to_matrix(checked, table)
        self.state.copy_(rows)
        self._spare.copy_(rows)  # its step's columns, which the shift does not write
        counts = _spike_state.counters(checked)
        self._host = self._host_values(*counts, [math.nan] * len(self.signals))
        self._in_flight = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self.state is not None:  # tensors go through the state dict, as the scale does
            state["_pending_load"] = self.state_dict()
        for name in (
            "state",
            "_spare",
            "_flags",
            "_slots",
            "_norms",
            "_roots",
            "_device",
            "_loss",
            "_microbatch_sum",
            "_in_flight",
        ):
            state[name] = None
        state["_consts"] = {}
        state["_zeros"] = torch.zeros(len(self.signals), dtype=torch.float64)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A fresh gate with the pickled one's settings, window and counters.

        Only those are read from ``state``: a gate pickled by an earlier version (0010076 kept
        a ring, not the matrix) lacks this one's other attributes, and holds its window in
        ``_pending_load`` as a state dict, as this version's does.
        """
        self.__init__(  # type: ignore[misc]
            state["signals"], sigma=state["sigma"], window=state["window"], warmup=state["warmup"]
        )
        self._pending_load = state.get("_pending_load")
        self.pipelined = state.get("pipelined", False)
        self.microbatch_reduction = state.get("microbatch_reduction", "mean")
        if "_host" in state:
            self._host = state["_host"]


def _out(op: Any, *args: Any, out: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``op(*args, out=out)``; under torch.compile computed, then copied (dynamo refuses an
    ``out=`` that is not contiguous)."""
    if torch.compiler.is_compiling():
        return out.copy_(op(*args, **kwargs))
    return op(*args, out=out, **kwargs)  # type: ignore[no-any-return]


def tensors_in(outputs: Any) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (list, tuple)):
        return [t for item in outputs for t in tensors_in(item)]
    return []
