"""Rank disagreement detector: every N steps, do all ranks hold the same loss scale?

They always should (the scaler agrees on overflow with one all-reduce). If they ever do not, the
ranks are training with different effective learning rates and users must know at once, so a
mismatch is logged as a warning on every rank and counted in ``dscale_rank_scale_mismatch_total``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from dscale import _agreement, _dist

logger = logging.getLogger(__name__)


def scale_min_max(scale: Tensor, group: Any = None) -> tuple[float, float]:
    """Min and max of the scale over the ranks of ``group`` (default: all ranks).

    The collective goes through ``dscale._agreement`` like every other one. It waits for the result
    (a host sync), which is why it runs every N steps only.
    """
    resolved = _dist.resolve_group(group)
    if resolved is None:
        x = float(scale)
        return x, x
    device = _dist.flag_device(resolved, scale.device)
    value = scale.detach().reshape(1).to(device=device, dtype=torch.float64)
    lo, hi = _agreement.all_reduce_min_max(value, resolved)
    return float(lo.cpu()), float(hi.cpu())


class RankScaleCheck:
    """A ``GradObserver`` that compares the scale across ranks after every ``every``-th update.

    Every rank must attach it with the same ``every`` (``start_exporter`` does), since it issues a
    collective. ``mismatches`` counts checks that found a difference.
    """

    def __init__(self, every: int, group: Any = None) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(
                f"check_agreement_every must be an int >= 1, got {every!r}; it is how many steps "
                "pass between cross-rank scale checks (each costs one small all-reduce)"
            )
        self.every = every
        self.group = group
        self.mismatches = 0
        self.last_min: float | None = None
        self.last_max: float | None = None
        self._updates = 0

    def on_grads(self, optimizer: Any, grads: list[Tensor], scale: Tensor) -> None:
        """Nothing to do before the check."""

    def on_update(self, scaler: Any, found_inf: Tensor) -> None:
        """Every ``every`` updates, compare this rank's scale with the others'."""
        self._updates += 1
        if self._updates % self.every:
            return
        lo, hi = scale_min_max(scaler.counters()["scale"], self.group)
        self.last_min, self.last_max = lo, hi
        if lo != hi:
            self.mismatches += 1
            logger.warning(
                "ranks disagree on the loss scale after %d updates: min %g, max %g. The scaler "
                "should keep them equal; check that every rank uses dscale.GradScaler with the "
                "same process_group and that no rank loaded a different checkpoint",
                self._updates,
                lo,
                hi,
            )
