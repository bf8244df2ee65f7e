"""The built-in demo, the default entrypoint: a small GPT or MLP on synthetic or text bytes.

It is an entrypoint like any user's (``entrypoint=launch.demo:main``): everything it uses comes
from the run context; its own config is the ``model`` and ``data`` groups and ``trainer.lr``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from launch.context import RunContext
from launch.data import build_batches
from launch.loop import train
from launch.models import build_model

logger = logging.getLogger(__name__)


def main(ctx: RunContext) -> dict[str, Any]:
    """Train the demo model; return the job's loss and speed (rank 0's go to the summary)."""
    cfg = ctx.config
    data, model_cfg = cfg["data"], cfg["model"]
    model = ctx.parallelize(build_model(model_cfg, seq_len=data["seq_len"]))
    # trainer.compile_step: the foreach form, which the compiled region steps on the device
    # (torch's default on the CPU is the per-parameter loop; on CUDA it is foreach already).
    foreach = True if cfg["trainer"].get("compile_step") else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["trainer"]["lr"], foreach=foreach)
    checkpoints = ctx.checkpoints(model, optimizer)
    start = checkpoints.resume() or 0
    batches = build_batches(data, seed=ctx.seed, rank=ctx.rank, vocab_size=model_cfg["vocab_size"])
    logger.info(
        "world %d, device %s, %s, %s, resumed from %s",
        ctx.world_size,
        ctx.device,
        cfg["parallel"]["strategy"],
        ctx.precision,
        checkpoints.resumed_from,
    )
    with ctx.metrics(model, optimizer):
        result = train(
            ctx,
            model=model,
            optimizer=optimizer,
            batches=batches,
            checkpoints=checkpoints,
            start=start,
            tokens_per_step=ctx.world_size * data["batch_size"] * data["seq_len"],
        )
    checkpoints.close()
    losses = result.losses
    return {
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        # None, never 0 or negative, when this run trained no step (it resumed at max_steps).
        "tokens_per_s": result.tokens / result.seconds if result.tokens > 0 else None,
        "train_seconds": result.seconds,
    }
