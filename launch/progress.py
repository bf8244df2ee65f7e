"""Rank 0's progress bar and periodic log lines; every other rank gets a do-nothing object."""

from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger(__name__)


class Progress:
    """Silent progress: what non-coordinator ranks use, so the loop never asks "am I rank 0"."""

    def __init__(self, max_steps: int, log_every: int, tokens_per_step: int) -> None:
        self.max_steps = max_steps
        self.log_every = max(1, log_every)
        self.tokens_per_step = tokens_per_step

    def wants_loss(self, step: int) -> bool:
        """Whether the loop should read the loss (a host sync) at this step."""
        return (step + 1) % self.log_every == 0 or step + 1 == self.max_steps

    def update(self, step: int, loss: float, scale: float, skipped: int) -> None:
        """Called at every step where ``wants_loss`` was true."""

    def close(self) -> None:
        """End the bar's line."""


class RankZeroProgress(Progress):
    """A one-line bar on a terminal plus a log line every ``log_every`` steps."""

    def __init__(self, max_steps: int, log_every: int, tokens_per_step: int) -> None:
        super().__init__(max_steps, log_every, tokens_per_step)
        self._bar = sys.stderr.isatty()
        self._t0 = time.perf_counter()
        self._last = (self._t0, -1)

    def update(self, step: int, loss: float, scale: float, skipped: int) -> None:
        now = time.perf_counter()
        t_last, s_last = self._last
        tokens_s = (step - s_last) * self.tokens_per_step / max(now - t_last, 1e-9)
        self._last = (now, step)
        line = (
            f"step {step + 1}/{self.max_steps} loss {loss:.4f} scale {scale:g} "
            f"skipped {skipped} tokens/s {tokens_s:,.0f}"
        )
        if self._bar:
            done = int(30 * (step + 1) / self.max_steps)
            sys.stderr.write(f"\r[{'#' * done}{'.' * (30 - done)}] {line}\033[K")
            sys.stderr.flush()
        # On a terminal the bar shows the line; keep the console clean and log it to file only.
        logger.info(line, extra={"console": not self._bar})

    def close(self) -> None:
        if self._bar:
            sys.stderr.write("\n")
            sys.stderr.flush()
