"""Which optimizer iterations this rank skipped, recorded for any entrypoint and checkpointed.

The record follows the scaler: a step callback notes every skipped step under the scaler's own
iteration index (the number of ``update()`` calls so far, which a checkpoint restores), so the
launcher knows the skipped steps of code it did not write, across resumes. The record keeps
those 0-based indices (the checkpoint format, so older checkpoints resume as they were) and
shows them as step numbers from 1, as the progress line and ``fault.*`` count (docs/launcher.md).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from dscale import GradScaler

logger = logging.getLogger(__name__)

# A checkpoint loads into tensors of the saved shape, so the record has a fixed size.
SKIP_CAPACITY = 4096


class SkipRecord:
    """The first ``SKIP_CAPACITY`` skipped steps and their total count, on this rank.

    ``skipped_steps`` numbers them from 1 (the 10th step is 10), as the launcher prints them.

    ``state_dict()`` holds them as tensors (DCP pickles non-tensor values), padded with -1.
    Attached to a scaler, it records skips on its own; with fused or ``sync_free`` steps that
    makes ``step()`` read the agreed flag (a host sync on GPU), as any step callback does.
    """

    def __init__(self) -> None:
        self._indices: list[int] = []  # 0-based, as the scaler counts and checkpoints hold them
        self.num_skipped = 0
        self._last: int | None = None
        self._unregister: Any = None

    def attach(self, scaler: GradScaler) -> None:
        """Record every skipped step of ``scaler`` from now on (no-op for a disabled scaler)."""
        if not scaler.is_enabled():
            return

        def on_step(optimizer: torch.optim.Optimizer, applied: bool) -> None:
            if not applied:
                self.record_skip(int(scaler.snapshot()["steps"]))

        self._unregister = scaler.register_step_callback(on_step)

    def detach(self) -> None:
        """Stop recording from the scaler's callback (``trainer.compile_step``: the loop feeds
        :meth:`record_skip` from outside the compiled region instead)."""
        if self._unregister is not None:
            self._unregister()
            self._unregister = None

    def record_skip(self, step: int) -> None:
        """Note that 0-based iteration ``step`` was skipped (once, however many optimizers did)."""
        if step == self._last:
            return
        self._last = step
        self.num_skipped += 1
        if len(self._indices) < SKIP_CAPACITY:
            self._indices.append(step)
        # Every rank logs this, so the logs show that the ranks skipped the same step.
        logger.info(
            "step %d skipped (inf/NaN gradients, or a spike with scaler.spike_signals)", step + 1
        )

    @property
    def skipped_steps(self) -> list[int]:
        """The skipped steps numbered from 1 (the 10th step is 10), as the launcher prints them."""
        return [s + 1 for s in self._indices]

    def state_dict(self) -> dict[str, Any]:
        padded = torch.full((SKIP_CAPACITY,), -1, dtype=torch.int64)
        padded[: len(self._indices)] = torch.tensor(self._indices, dtype=torch.int64)
        return {"skipped_steps": padded, "num_skipped": torch.tensor(self.num_skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._indices = [s for s in state["skipped_steps"].tolist() if s >= 0]
        self.num_skipped = int(state["num_skipped"])
