"""MetricsLog: a per-step JSONL log of the scale, for ``python -m dscale.report`` and for grep.

Columns: rank, step (the 0-based index of the optimizer iteration; the launcher numbers steps
from 1, so its step 10 is row 9 here), scale (after that iteration's update), skipped, growths,
backoffs (totals), clean_steps (the growth tracker), grad_norm and grad_norm_scaled (null without
stats or before the first applied step), loss (what ``note_loss`` was given that iteration, else
null). The first row of a log that starts past step 0 (a resumed run) also has ``"resumed": true``;
a StepGuard's rows have ``"loss_scaling": false`` (its scale is fixed at 1), and with a spike
gate the first row of each log has ``"spike": {"signals", "sigma", "window", "warmup"}``.

Each update() writes one row into a device buffer (no host sync); every ``every`` steps the buffer
is copied to the host once and appended to ``RUN_DIR/metrics/rank<R>.jsonl``. So the log has the
full per-step sawtooth while the GPU waits only once per ``every`` steps. ``log_loss`` appends the
loss (host numbers the loop already read) to ``RUN_DIR/metrics/loss-rank<R>.jsonl``. When a
``dscale.fp8.Float8Numerics`` watches the scaler, each of its samples (already on the host) is
appended to ``RUN_DIR/metrics/fp8-rank<R>.jsonl``: ``{"rank", "step", "layers": snapshot()}``;
a ``dscale.precision.ShadowNumerics``'s to ``shadow-rank<R>.jsonl`` (dscale/precision/_report.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

import torch
from torch import Tensor

from dscale.fp8 import _attached
from dscale.precision._report import log_shadow
from dscale.stats import NumericsStats

logger = logging.getLogger(__name__)

_COLUMNS = (
    "step",
    "scale",
    "skipped",
    "growths",
    "backoffs",
    "clean_steps",
    "grad_norm",
    "grad_norm_scaled",
    "loss",
)
_INT_COLUMNS = ("step", "growths", "backoffs", "clean_steps")


class MetricsLog:
    """A ``GradObserver`` that logs one JSON line per optimizer iteration, flushed every N steps.

    Attach it *after* the ``NumericsStats`` it reads (observers run in the order they were added),
    and call ``close()`` at the end so the last partial block is written.

    Example::

        stats = track_numerics(scaler, model)
        log = MetricsLog(run_dir, stats=stats, rank=rank, every=100)
        scaler.add_observer(log)
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        stats: NumericsStats | None = None,
        rank: int = 0,
        every: int = 100,
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(
                f"every must be an int >= 1, got {every!r}; it is how many steps are buffered on "
                "the device between writes (each write is one host sync)"
            )
        self.path = os.path.join(os.fspath(run_dir), "metrics", f"rank{rank}.jsonl")
        self.loss_path = os.path.join(os.path.dirname(self.path), f"loss-rank{rank}.jsonl")
        self.fp8_path = os.path.join(os.path.dirname(self.path), f"fp8-rank{rank}.jsonl")
        self._fp8_step: int | None = None  # the FP8 sample last written
        self._shadow_step: int | None = None  # the shadow numerics sample last written
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.rank = rank
        self.every = every
        self._stats = stats
        self._buf: Tensor | None = None
        self._filled = 0
        self._loss: Tensor | None = None
        self._first_block = True
        # What the report needs to know of the scaler, read once (host attributes, no sync).
        self._loss_scaling = True
        self._spike: dict[str, Any] | None = None
        self._described = False

    def note_loss(self, loss: Tensor) -> None:
        """Log ``loss`` (this iteration's, unscaled) in the row of the next update().

        Keeps a reference to the tensor (no host sync); its value is copied with the row, and
        read with the block, every ``every`` steps. A step with no loss noted logs null.
        """
        self._loss = loss

    def on_grads(self, optimizer: Any, grads: list[Tensor], scale: Tensor) -> None:
        """Nothing to do before the check."""

    def on_update(self, scaler: Any, found_inf: Tensor) -> None:
        """Record this iteration's row on the device; write the block when it is full."""
        if not self._described:
            self._described = True
            self._loss_scaling = bool(getattr(scaler, "_loss_scaling", True))
            gate = getattr(scaler, "_spike", None)
            if gate is not None:
                self._spike = {
                    "signals": list(gate.signals),
                    "sigma": gate.sigma,
                    "window": gate.window,
                    "warmup": gate.warmup,
                }
        c = scaler.counters()
        device = c["scale"].device
        nan = torch.full((), float("nan"), device=device)  # made on the device: no blocking copy
        extra = self._stats.device_values() if self._stats is not None else {}
        values = [
            c["steps"] - 1,  # the count of iterations done, so the index of this one is one less
            c["scale"],
            found_inf.reshape(()) > 0,
            c["growths"],
            c["backoffs"],
            c["growth_tracker"],
            extra.get("grad_norm", nan),
            extra.get("grad_norm_scaled", nan),
            nan if self._loss is None else self._loss.detach().reshape(()),
        ]
        self._loss = None
        row = torch.stack([v.detach().to(device=device, dtype=torch.float64) for v in values])
        if self._buf is None:
            self._buf = torch.empty(self.every, len(_COLUMNS), dtype=torch.float64, device=device)
        self._buf[self._filled].copy_(row)
        self._filled += 1
        if self._filled == self.every:
            self.flush()
        self._log_fp8(scaler)
        self._shadow_step = log_shadow(
            os.path.dirname(self.path), self.rank, scaler, self._shadow_step
        )

    def _log_fp8(self, scaler: Any) -> None:
        """Append a new FP8 numerics sample (host numbers already read after the step)."""
        numerics = _attached.numerics_of(scaler)
        # A sample of the step just finished only: a numerics loaded from a checkpoint holds
        # the saved run's last sample, which that run's log already has.
        if numerics is None or not numerics.sampled_last_step:
            return
        step = numerics.sample_step
        if step == self._fp8_step:
            return
        self._fp8_step = step
        rec = {"rank": self.rank, "step": step, "layers": numerics.snapshot()}
        with open(self.fp8_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")

    def flush(self) -> None:
        """Write the buffered rows. This waits for the GPU."""
        if self._buf is None or self._filled == 0:
            return
        rows = self._buf[: self._filled].cpu().tolist()
        self._filled = 0
        first, self._first_block = self._first_block, False
        with open(self.path, "a", encoding="utf-8") as f:
            for row in rows:
                rec: dict[str, Any] = {"rank": self.rank}
                for key, value in zip(_COLUMNS, row, strict=True):
                    rec[key] = value if math.isfinite(value) else None
                for key in _INT_COLUMNS:
                    rec[key] = int(rec[key])
                rec["skipped"] = bool(rec["skipped"])
                if first and rec["step"] > 0:  # this log continues a run from a checkpoint
                    rec["resumed"] = True
                if not self._loss_scaling:  # a StepGuard: the scale is fixed at 1
                    rec["loss_scaling"] = False
                if first and self._spike is not None:
                    rec["spike"] = self._spike
                first = False
                f.write(json.dumps(rec) + "\n")

    def log_loss(self, step: int, loss: float, **values: float) -> None:
        """Append ``{"step", "loss", **values}`` (e.g. ``lr=``) to ``metrics/loss-rank<R>.jsonl``.

        Takes host numbers, so it adds no sync of its own: call it where the loop already read the
        loss (``loss.item()``). ``python -m dscale.report`` draws these in a loss panel.
        """
        rec: dict[str, Any] = {"rank": self.rank, "step": int(step), "loss": float(loss)}
        rec.update({k: float(v) for k, v in values.items()})
        with open(self.loss_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        """Write what is left in the buffer."""
        self.flush()
