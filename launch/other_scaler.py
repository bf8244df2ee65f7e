"""Notice an entrypoint that steps its optimizer through its own GradScaler instead of ctx.scaler.

The launcher reports ``ctx.scaler`` (progress lines, skipped steps, ``summary.json``). A loop that
builds ``dscale.GradScaler()`` or ``torch.amp.GradScaler()`` itself would leave that report on an
unused scaler at its initial scale with no skips. While the entrypoint runs, ``step()`` of both
classes is watched: the first step through another scaler logs a warning, and when that scaler
is a ``dscale.GradScaler`` and ``ctx.scaler`` has not stepped, the progress lines, the skip record
and the summary follow the scaler the job uses.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from dscale import GradScaler
from launch.context import RunContext

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def follow_the_scaler_used(ctx: RunContext) -> Iterator[None]:
    """Watch ``GradScaler.step`` while the block runs; see the module docstring."""
    seen: list[Any] = []
    originals = {cls: cls.step for cls in {GradScaler, torch.amp.GradScaler}}

    def noticed(scaler: Any) -> None:
        seen.append(scaler)
        unused = not ctx.scaler.is_enabled() or int(ctx.scaler.snapshot()["steps"]) == 0
        adopt = isinstance(scaler, GradScaler) and scaler.is_enabled() and unused
        logger.warning(
            "rank %d: the entrypoint stepped an optimizer through a %s.%s that is not ctx.scaler; "
            "%s. Use ctx.scaler (built from scaler.* in the config) so that the scale, skipped "
            "steps and metrics are those of the scaler that trains",
            ctx.rank,
            type(scaler).__module__,
            type(scaler).__qualname__,
            "progress, skipped steps and summary.json now follow that scaler (the metrics "
            "exporter and log still watch ctx.scaler)"
            if adopt
            else "progress, skipped steps, summary.json and metrics report ctx.scaler, not it",
        )
        if adopt:
            ctx.record.attach(scaler)
            ctx.progress.scaler = scaler
            ctx.scaler = scaler

    def watched(original: Any) -> Any:
        def step(self: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if self is not ctx.scaler and not any(self is s for s in seen):
                noticed(self)
            return original(self, optimizer, *args, **kwargs)

        return step

    for cls, original in originals.items():
        cls.step = watched(original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.step = original  # type: ignore[method-assign]
