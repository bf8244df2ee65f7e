"""Rank 0's progress bar and periodic log lines; every other rank gets a do-nothing object."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

import torch

from dscale import GradScaler, StepGuard
from dscale.metrics import MetricsLog, TrainingFigures
from dscale.stats import NumericsStats
from launch.record import SkipRecord

logger = logging.getLogger(__name__)


def _duration(seconds: float) -> str:
    """``1m05s`` or ``42s``."""
    s = max(0, round(seconds))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """Silent progress: what non-coordinator ranks use, so a loop never asks "am I rank 0".

    ``ctx.progress`` in a user's loop::

        if ctx.progress.wants_loss(step):
            ctx.progress.update(step, loss.item(), tokens=tokens_this_step)
    """

    def __init__(
        self, max_steps: int, log_every: int, scaler: GradScaler, record: SkipRecord
    ) -> None:
        self.max_steps = max_steps
        self.log_every = max(1, log_every)
        self.scaler = scaler
        self.record = record
        # Set by ``ctx.metrics(...)`` while the metrics log is open: the loss goes there too.
        self.loss_log: MetricsLog | None = None
        # What this rank's /metrics serves of the loop (rank-local; host numbers only).
        self.figures = TrainingFigures()
        # Set by ``ctx.metrics(...)``: the grad norm a StepGuard's lines show.
        self.stats: NumericsStats | None = None
        # Set by ``ctx.metrics(...)`` with metrics.tensorboard: gets (step, figures) each report.
        self.scalars: Callable[[int, dict[str, float]], None] | None = None

    def wants_loss(self, step: int) -> bool:
        """Whether the loop should read the loss (a host sync) at this 0-based step."""
        return (step + 1) % self.log_every == 0 or step + 1 == self.max_steps

    def note_loss(self, loss: torch.Tensor) -> None:
        """This step's loss for the per-step metrics log (``python -m dscale.report``).

        Call it every step, before ``scaler.update()``; the value is read with the log's block
        every ``trainer.log_every`` steps, so it adds no host sync.
        """
        if self.loss_log is not None:
            self.loss_log.note_loss(loss)

    def update(self, step: int, loss: float, *, tokens: int = 0) -> None:
        """Report step ``step``; ``tokens``: tokens per step over all ranks, for tokens/s."""
        self.figures.update(step, loss=loss, tokens=tokens)
        if self.scalars is not None:
            self.scalars(step, self.figures.values())

    def numerics(self) -> str:
        """``scale 65536 skipped 0`` under a loss scaler; what a StepGuard has otherwise.

        A guard's scale is fixed at 1, so its line shows the skipped steps, the spike skips
        (with ``scaler.spike_signals``) and the grad norm of the last applied step (with
        metrics on). Read where the loop already read the loss.
        """
        if not isinstance(self.scaler, StepGuard):
            return f"scale {self.scaler.get_scale():g} skipped {self.record.num_skipped}"
        parts = [f"skipped {self.record.num_skipped}"]
        snap = self.scaler.snapshot()
        if "spike_skipped_steps" in snap:
            parts.append(f"spikes {int(snap['spike_skipped_steps'])}")
        if self.stats is not None:
            norm = self.stats.device_values().get("grad_norm")
            if norm is not None:
                parts.append(f"grad norm {float(norm):.4g}")
        return " ".join(parts)

    def close(self) -> None:
        """End the bar's line."""


class RankZeroProgress(Progress):
    """A one-line bar on a terminal plus a log line every ``log_every`` steps."""

    def __init__(
        self, max_steps: int, log_every: int, scaler: GradScaler, record: SkipRecord
    ) -> None:
        super().__init__(max_steps, log_every, scaler, record)
        self._bar = sys.stderr.isatty()
        # The first report only sets the baseline: a loop that resumed at step 50 reports step 50
        # first, and counting from step -1 (or from before model setup) would inflate tokens/s.
        self._last: tuple[float, int] | None = None

    def update(self, step: int, loss: float, *, tokens: int = 0) -> None:
        now = time.perf_counter()
        self.figures.update(step, loss=loss, tokens=tokens, now=now)
        if self.scalars is not None:
            self.scalars(step, self.figures.values())
        last, self._last = self._last, (now, step)
        line = f"step {step + 1}/{self.max_steps} loss {loss:.4f} {self.numerics()}"
        if last is not None and step > last[1]:
            t_last, s_last = last
            per_s = (step - s_last) / max(now - t_last, 1e-9)
            if tokens:
                line += f" tokens/s {per_s * tokens:,.0f}"
            line += f" it/s {per_s:.1f} ETA {_duration((self.max_steps - step - 1) / per_s)}"
        if self._bar:
            done = min(30, int(30 * (step + 1) / self.max_steps))
            sys.stderr.write(f"\r[{'#' * done}{'.' * (30 - done)}] {line}\033[K")
            sys.stderr.flush()
        # On a terminal the bar shows the line; keep the console clean and log it to file only.
        logger.info(line, extra={"console": not self._bar})
        if self.loss_log is not None:
            self.loss_log.log_loss(step, loss)

    def close(self) -> None:
        if self._bar:
            sys.stderr.write("\n")
            sys.stderr.flush()
