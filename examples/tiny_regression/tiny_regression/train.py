"""The project's training function: ``dscale-launch entrypoint=tiny_regression.train:main``.

Everything distributed comes from the run context: the wrapped model, the loss scaler, the
checkpoints, the metrics endpoint, progress and fault injection. The loop is the project's own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from launch import RunContext
from tiny_regression.model import Regressor, batch


def build_optimizer(params: Any, optim: Any) -> torch.optim.Optimizer:
    """From this project's own config group, ``args/optim``."""
    if optim.name == "sgd":
        return torch.optim.SGD(params, lr=optim.lr, momentum=optim.momentum)
    if optim.name == "adam":
        return torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay)
    raise ValueError(f"args.optim.name={optim.name!r}; choose args/optim=sgd or adam")


def main(ctx: RunContext) -> dict[str, Any]:
    """Train on every rank; the returned dict goes into summary.json (rank 0's on top)."""
    a = ctx.args
    model = ctx.parallelize(Regressor(a.features, a.hidden, a.layers))
    optimizer = build_optimizer(model.parameters(), a.optim)
    checkpoints = ctx.checkpoints(model, optimizer)
    start = checkpoints.resume() or 0
    loss = None
    with ctx.metrics(model, optimizer):
        for step in range(start, ctx.max_steps):
            ctx.faults.before_step(step)
            x, y = batch(
                step,
                rank=ctx.rank,
                seed=ctx.seed,
                features=a.features,
                batch_size=a.batch_size,
                noise=a.noise,
            )
            with ctx.autocast():
                pred = model(x.to(ctx.device))
            loss = F.mse_loss(pred.float(), y.to(ctx.device))
            ctx.scaler.scale(loss).backward()
            ctx.faults.after_backward(step, model)  # fault.inf_steps: an inf on fault.inf_rank
            ctx.scaler.step(optimizer)
            ctx.scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if ctx.progress.wants_loss(step):
                ctx.progress.update(step, loss.item())
            checkpoints.maybe_save(step + 1)
        checkpoints.save(ctx.max_steps)
    checkpoints.close()
    return {
        "final_loss": None if loss is None else loss.item(),
        "optimizer": a.optim.name,
        "lr": a.optim.lr,
        "layers": a.layers,
        "tag": a.get("tag"),
    }
