"""The training loop itself: forward under autocast, scaled backward, step, record, checkpoint."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from launch.data import Batches
from launch.faults import Faults
from launch.progress import Progress

logger = logging.getLogger(__name__)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class Saver(Protocol):
    """Saves a checkpoint after ``step`` steps (``launch/integrations.py``)."""

    def maybe_save(self, step: int, *, final: bool) -> None: ...


# A checkpoint loads into tensors of the saved shape, so the record has a fixed size.
SKIP_CAPACITY = 4096


@dataclass
class TrainState:
    """Where the loop is, and which steps this rank skipped; checkpointed so resumes continue it.

    ``state_dict()`` holds the first ``SKIP_CAPACITY`` skipped step indices (padded with -1) and
    their total count, as tensors: DCP pickles non-tensor values.
    """

    step: int = 0
    skipped_steps: list[int] = field(default_factory=list)
    num_skipped: int = 0

    def record_skip(self, step: int) -> None:
        self.num_skipped += 1
        if len(self.skipped_steps) < SKIP_CAPACITY:
            self.skipped_steps.append(step)

    def state_dict(self) -> dict[str, Any]:
        padded = torch.full((SKIP_CAPACITY,), -1, dtype=torch.int64)
        padded[: len(self.skipped_steps)] = torch.tensor(self.skipped_steps, dtype=torch.int64)
        return {"skipped_steps": padded, "num_skipped": torch.tensor(self.num_skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = [s for s in state["skipped_steps"].tolist() if s >= 0]
        self.num_skipped = int(state["num_skipped"])


@dataclass
class LoopResult:
    losses: list[float]
    tokens: int
    seconds: float


def train(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    batches: Batches,
    faults: Faults,
    saver: Saver,
    state: TrainState,
    max_steps: int,
    precision: str,
    device: torch.device,
    progress: Progress,
) -> LoopResult:
    """Run steps ``state.step`` .. ``max_steps - 1``; every rank records the steps it skipped."""
    dtype = DTYPES[precision]
    losses: list[float] = []
    tokens = 0
    start, first_step = time.perf_counter(), state.step
    while state.step < max_steps:
        step = state.step
        faults.before_step(step)
        batch = batches(step).to(device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with torch.autocast(device.type, dtype=dtype, enabled=precision != "fp32"):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        scaler.scale(loss).backward()
        faults.after_backward(step, model)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if not scaler.step_applied(optimizer):
            state.record_skip(step)
            # Every rank logs this, so the logs show that the ranks skipped the same step.
            logger.info(
                "step %d skipped (inf/NaN gradients); scale now %g", step, scaler.get_scale()
            )
        state.step += 1
        tokens += targets.numel()
        if step == first_step or progress.wants_loss(step):
            losses.append(loss.item())
            progress.update(step, losses[-1], scaler.get_scale(), state.num_skipped)
        saver.maybe_save(state.step, final=state.step == max_steps)
    return LoopResult(losses=losses, tokens=tokens, seconds=time.perf_counter() - start)
