"""Rank disagreement detector: every N steps, do all ranks hold the same loss scale?

They always should (the scaler agrees on overflow with one all-reduce). If they ever do not, the
ranks are training with different effective learning rates and users must know at once, so a
mismatch is logged as a warning on every rank and counted in ``dscale_rank_scale_mismatch_total``.

The check runs no collective of its own: the scaler's agreement vector carries the scale's min and
max over the ranks on every ``RANGE_EVERY``-th update (``GradScaler.agreed_scale_range()``). So it
cannot hang a job that attaches it on some ranks only (metrics served from rank 0), and costs a
host read per check, nothing in between. A check that falls due between two such updates runs at
the next one.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from dscale.scaler._program.agreement import RANGE_EVERY

logger = logging.getLogger(__name__)


class RankScaleCheck:
    """A ``GradObserver`` that compares the scale across ranks after every ``every``-th update.

    ``mismatches`` counts checks that found a difference; ``unchecked`` counts due checks that
    found no range to read within ``RANGE_EVERY`` updates (no scaler collective ran).
    """

    def __init__(self, every: int) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(
                f"check_agreement_every must be an int >= 1, got {every!r}; it is how many steps "
                "pass between cross-rank scale checks (each reads two numbers on the host)"
            )
        self.every = every
        self.mismatches = 0
        self.unchecked = 0
        self.last_min: float | None = None
        self.last_max: float | None = None
        self._updates = 0
        self._waited: int | None = (
            None  # updates a due check has waited for a range; None: none due
        )

    def on_grads(self, optimizer: Any, grads: list[Tensor], scale: Tensor) -> None:
        """Nothing to do before the check."""

    def on_update(self, scaler: Any, found_inf: Tensor) -> None:
        """Every ``every`` updates, read the scale range at the next update that carried one."""
        self._updates += 1
        if self._updates % self.every == 0 and self._waited is None:
            self._waited = 0
        if self._waited is None:
            return
        agreed = scaler.agreed_scale_range()
        if agreed is None:
            self._waited += 1
            if self._waited >= RANGE_EVERY:  # a range would have come by now: none runs
                self.unchecked += 1
                self._waited = None
            return
        self._waited = None
        lo, hi = torch.stack([t.detach().reshape(()) for t in agreed]).tolist()  # host read
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
