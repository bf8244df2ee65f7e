"""The demo's training loop: forward under autocast, scaled backward, step, record, checkpoint."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from launch.compiled_step import CompiledStep
from launch.context import RunContext
from launch.data import Batches
from launch.integrations import Checkpoints


@dataclass
class LoopResult:
    losses: list[float]
    tokens: int
    seconds: float


def train(
    ctx: RunContext,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Batches,
    checkpoints: Checkpoints,
    start: int,
    tokens_per_step: int,
) -> LoopResult:
    """Run steps ``start`` .. ``ctx.max_steps - 1``; the context records the skipped ones.

    With ``trainer.compile_step=true`` the post-backward region (``scaler.step`` and
    ``scaler.update``) is compiled fullgraph after an eager warm-up (launch/compiled_step.py).
    """
    scaler, device = ctx.scaler, ctx.device
    trainer = ctx.config["trainer"]
    compiled = (
        CompiledStep(
            scaler, optimizer, ctx.record, backend=trainer.get("compile_backend", "inductor")
        )
        if trainer.get("compile_step")
        else None
    )
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(start, ctx.max_steps):
        ctx.faults.before_step(step)
        batch = batches(step).to(device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with ctx.autocast():
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss = ctx.faults.after_forward(step, loss)
        ctx.progress.note_loss(loss)  # the per-step loss log; read every log_every steps
        scaler.scale(loss).backward()
        ctx.faults.after_backward(step, model)
        if compiled is not None:
            compiled()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step == start or ctx.progress.wants_loss(step):
            losses.append(loss.item())
            ctx.progress.update(step, losses[-1], tokens=tokens_per_step)
        checkpoints.maybe_save(step + 1)
    checkpoints.save(ctx.max_steps)  # a no-op when the run resumed at or past max_steps
    seconds = time.perf_counter() - t0
    return LoopResult(losses, max(0, ctx.max_steps - start) * tokens_per_step, seconds)
