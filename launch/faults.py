"""Fault injection: an inf in one rank's gradients, a loss spike on one rank, or a SIGKILL.

An inf on one rank is the case dscale exists for: every rank must skip that step together. A
SIGKILL exercises elastic restarts and resume from the last checkpoint.

Steps are numbered from 1, as everywhere the launcher prints or takes one (docs/launcher.md):
``fault.inf_steps=[10]`` is the 10th step, logged as ``step 10``. The methods take the loop's
0-based index (``for step in range(start, ctx.max_steps)``) and add the 1 themselves.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 grads are DTensors; poison this rank's shard only.
    return t.to_local() if hasattr(t, "to_local") else t


def poison_grads(model: nn.Module) -> None:
    """Write an inf into the first gradient this rank holds."""
    for p in model.parameters():
        if p.grad is not None and _local(p.grad).numel() > 0:
            _local(p.grad).view(-1)[0] = float("inf")
            return
    raise RuntimeError("no gradient to poison on this rank; call after backward()")


class Faults:
    """Decides, per step, whether this rank injects an inf or kills itself.

    ``fault.*`` holds step numbers (1-based); each method takes the loop's 0-based ``step``.
    """

    def __init__(self, fault: dict[str, Any], rank: int, attempt: int) -> None:
        self.inf_steps = frozenset(fault["inf_steps"])
        self.inf_here = rank == fault["inf_rank"]
        self.spike_steps = frozenset(fault.get("spike_steps", ()))
        self.spike_here = rank == fault.get("spike_rank", 1)
        self.spike_factor = float(fault.get("spike_factor", 1000.0))
        self.kill_step = fault["kill_step"]
        self.kill_here = rank == fault["kill_rank"] and attempt < fault["kill_attempts"]
        self.preempt_step = fault.get("preempt_step") if rank == 0 and attempt == 0 else None

    def after_forward(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss, multiplied by ``fault.spike_factor`` on the spiking rank at its steps."""
        if self.spike_here and step + 1 in self.spike_steps:
            logger.info(
                "fault: loss multiplied by %g on this rank at step %d", self.spike_factor, step + 1
            )
            return loss * self.spike_factor
        return loss

    def after_backward(self, step: int, model: nn.Module) -> None:
        if self.inf_here and step + 1 in self.inf_steps:
            logger.info("fault: inf injected into this rank's gradients at step %d", step + 1)
            poison_grads(model)

    def before_step(self, step: int) -> None:
        if step + 1 == self.preempt_step:
            # The launcher (the elastic agent, our parent) forwards SIGTERM to every worker.
            logger.warning("fault: SIGTERM to the launcher at step %d (preemption)", step + 1)
            os.kill(os.getppid(), signal.SIGTERM)
        if self.kill_here and step + 1 == self.kill_step:
            logger.warning("fault: SIGKILL of this rank at step %d", step + 1)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGKILL)
