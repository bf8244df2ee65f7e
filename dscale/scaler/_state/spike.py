"""The spike gate's state: its state-dict keys, their checks, and the window matrix they map to.

The state dict keeps the window as a ring (slot ``i % spike_window`` holds the i-th value that
entered) with three counters; :class:`~dscale.scaler._program.spike_gate.SpikeGate` keeps a
shift-register matrix on the device (its module docstring says why). This module converts between
the two on the host, so that a saved window loads into the same decisions whatever layout the
gate uses.

Matrix rows, after one row per watched value (``n`` of them), at ``n + offset``: ``ONES`` (1
where a slot holds a value), ``FACTORS`` (slot j: the threshold factor for the count j more
values will bring), ``SPIKES`` (spike skips as of the last entry in column ``window - 1``, spike
skips from column ``window`` on), ``ENTRIES`` (values that entered, from column ``window`` on).
Columns ``window`` and ``window + 1`` are the step's: its values, twice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

STATE_KEYS = (
    "spike_signals",
    "spike_window_values",
    "spike_window_entered",
    "num_spike_skipped_steps",
    "num_spike_skipped_in_a_row",
)
ONES, FACTORS, SPIKES, ENTRIES = range(4)
_COUNTER_KEYS = STATE_KEYS[2:]


def empty_state(signals: tuple[str, ...], window: int) -> dict[str, Any]:
    """The state of a gate that has seen nothing."""
    return {
        "spike_signals": ",".join(signals),
        "spike_window_values": torch.zeros(len(signals), window, dtype=torch.float64),
        "spike_window_entered": 0,
        "num_spike_skipped_steps": 0,
        "num_spike_skipped_in_a_row": 0,
    }


def check_state(
    state: Mapping[str, Any], signals: tuple[str, ...], window: int
) -> dict[str, Any] | None:
    """Validate the spike keys of a state dict; None when it has none (a fresh window)."""
    if "spike_window_values" not in state:
        return None
    watched = ",".join(signals)
    saved = state.get("spike_signals", watched)
    if saved != watched:
        raise ValueError(
            f"state_dict: spike_signals={saved!r} but this scaler watches {watched!r}; its "
            "window holds other values. Construct the scaler with the same spike_signals, or "
            "drop the spike_* keys to start a fresh window"
        )
    values = state["spike_window_values"]
    if not isinstance(values, torch.Tensor):
        values = torch.as_tensor(values, dtype=torch.float64)
    expected = (len(signals), window)
    if tuple(values.shape) != expected:
        raise ValueError(
            f"state_dict: spike_window_values has shape {tuple(values.shape)}, expected "
            f"{expected} (spike_window={window}); load it with the spike_window it was saved "
            "with, or drop the spike_* keys to start a fresh window"
        )
    out = {"spike_signals": saved, "spike_window_values": values.double().cpu()}
    for key in _COUNTER_KEYS:
        value = state.get(key, 0)
        if isinstance(value, torch.Tensor):
            value = int(value.item())
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"state_dict: {key} must be an int >= 0, got {value!r}")
        out[key] = value
    return out


def counters(checked: Mapping[str, Any]) -> tuple[int, int, int]:
    """(entered, spike skips, spike skips in a row) of a checked state."""
    return (
        checked["spike_window_entered"],
        checked["num_spike_skipped_steps"],
        checked["num_spike_skipped_in_a_row"],
    )


def factor_table(sigma: float, window: int, warmup: int) -> torch.Tensor:
    """[window + 1] float64: sigma / sqrt(n - 1) for n values, inf if n < warmup."""
    counts = torch.arange(window + 1, dtype=torch.float64)
    factor = sigma / (counts - 1).clamp(min=1).sqrt()
    return factor.masked_fill(counts < warmup, math.inf)


def to_matrix(checked: Mapping[str, Any], table: torch.Tensor) -> torch.Tensor:
    """The gate's matrix (on the host) for a checked state; ``table`` from :func:`factor_table`."""
    ring = checked["spike_window_values"].to(torch.float64).cpu()
    n, w = ring.shape
    entered, skipped, in_a_row = counters(checked)
    filled = min(entered, w)
    rows = torch.zeros(n + 4, w + 2, dtype=torch.float64)
    rows[:n, :w] = ring.roll(-(entered % w), dims=1)  # oldest first, newest last
    rows[n + ONES, w - filled :] = 1.0  # and the step's columns
    rows[:n, :w] *= rows[n + ONES, :w]  # a slot past the values saved is empty, whatever it held
    rows[n + FACTORS] = table[(torch.arange(w + 2) + filled).clamp(max=w)]
    rows[:n, w:] = math.nan  # no step's values yet
    rows[n + SPIKES, w - 1] = skipped - in_a_row  # the spike skips when the last value entered
    rows[n + SPIKES, w:] = skipped
    rows[n + ENTRIES, w:] = entered
    return rows


def to_ring(matrix: torch.Tensor, n: int, entered: int) -> torch.Tensor:
    """The window values of the gate's matrix in the state dict's ring layout, on the host."""
    w = matrix.shape[1] - 2
    # The i-th value that entered lives in slot i % window of the saved ring.
    return matrix[:n, :w].detach().cpu().roll(entered % w, dims=1).clone()
