"""TrainingFigures: the loop's loss, learning rate, tokens/s, step time and step, for /metrics.

The loop hands over host numbers it already has (the loss it read for its log line), so serving
them adds no host sync to the step; the learning rate is read from the optimizer at scrape time.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class TrainingFigures:
    """The latest training figures of this rank, as Python numbers, read by each scrape.

    Example::

        figures = TrainingFigures(optimizer)
        with start_exporter(scaler, training=figures):
            for step in range(steps):
                ...
                if step % 25 == 0:
                    figures.update(step, loss=loss.item(), tokens=tokens_per_step)
    """

    def __init__(self, optimizer: Any = None) -> None:
        self.optimizer = optimizer
        self.step: int | None = None
        self.loss: float | None = None
        self.tokens_per_s: float | None = None
        self.step_seconds: float | None = None
        self._last: tuple[float, int] | None = None

    def update(
        self, step: int, *, loss: float | None = None, tokens: int = 0, now: float | None = None
    ) -> None:
        """Note step ``step`` (0-based) and its loss; ``tokens``: tokens per step, all ranks.

        Step time and tokens/s are measured between two calls (``now``: the caller's
        ``time.perf_counter()``), so the first call only starts the clock (a resumed run does
        not count the steps before it).
        """
        now = time.perf_counter() if now is None else now
        last, self._last = self._last, (now, step)
        self.step = step
        if loss is not None:
            self.loss = float(loss)
        if last is not None and step > last[1]:
            self.step_seconds = max(now - last[0], 1e-9) / (step - last[1])
            self.tokens_per_s = tokens / self.step_seconds if tokens else None

    def learning_rate(self) -> float | None:
        """The first parameter group's ``lr`` now (None without an optimizer)."""
        groups = getattr(self.optimizer, "param_groups", None)
        if not groups:
            return None
        lr = groups[0].get("lr")
        if isinstance(lr, torch.Tensor):  # a tensor lr lives on the host for fused optimizers
            return float(lr.detach().cpu()) if lr.device.type == "cpu" else None
        return None if lr is None else float(lr)

    def values(self) -> dict[str, float]:
        """``{metric name: value}`` for the figures known so far."""
        out: dict[str, float] = {}
        for name, value in (
            ("dscale_train_step", self.step),
            ("dscale_train_loss", self.loss),
            ("dscale_train_learning_rate", self.learning_rate()),
            ("dscale_train_tokens_per_second", self.tokens_per_s),
            ("dscale_train_step_seconds", self.step_seconds),
        ):
            if value is not None:
                out[name] = float(value)
        return out


#: Help text of each gauge.
HELP = {
    "dscale_train_step": "The 0-based index of the last step the loop reported.",
    "dscale_train_loss": "The loss the loop last reported (rank-local).",
    "dscale_train_learning_rate": "The optimizer's learning rate (first parameter group).",
    "dscale_train_tokens_per_second": "Tokens per second over all ranks, between two reports.",
    "dscale_train_step_seconds": "Seconds per step, between two reports.",
}
