"""Rank functions for the FP8 resume test: save at step 3 through dscale.checkpoint, resume."""

from __future__ import annotations

from typing import Any

import torch

import dscale
import dscale.fp8 as fp8
from dscale.checkpoint import CheckpointManager, load_checkpoint
from tests.fp8 import _fsdp_ranks, _models


def _build(seed: int):
    torch.manual_seed(seed)
    model, conv = _fsdp_ranks.sharded()
    if seed:  # other weights than the saved run's: the load must bring them
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    guard = dscale.StepGuard("cpu")
    scales = fp8.WeightScales(model, opt, guard, conv)
    return model, opt, guard, scales


def _steps(rank, model, opt, guard, scales, steps) -> list[Any]:
    out = []
    for step in steps:
        tokens, target = _models.batch(step, rank)
        loss = _models.loss_of(model, tokens, target)
        guard.scale(loss).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
        out.append((loss.item(), scales.scales.tolist()))
    return out


def resume(rank: int, world: int, directory: str) -> dict[str, Any]:
    model, opt, guard, scales = _build(0)
    whole = _steps(rank, model, opt, guard, scales, range(6))

    model, opt, guard, scales = _build(0)
    first = _steps(rank, model, opt, guard, scales, range(3))
    ckpt = CheckpointManager(directory, every=0, keep=2)
    ckpt.save(3, model=model, optimizer=opt, scaler=guard, extra={"fp8_weight_scales": scales})
    ckpt.wait()

    out = {"whole": whole, "first": first}
    for name, extra in (("resumed", True), ("without_scales", False)):
        model, opt, guard, scales = _build(1)
        step = load_checkpoint(
            f"{directory}/step-3",
            model=model,
            optimizer=opt,
            scaler=guard,
            extra={"fp8_weight_scales": scales} if extra else None,
        )
        out[name] = _steps(rank, model, opt, guard, scales, range(step, 6))
    return out


def resume_on_one_rank(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Load the 2-rank checkpoint on 1 rank; the forward of step 3 on rank 0's batch."""
    model, opt, guard, scales = _build(1)
    load_checkpoint(
        f"{directory}/step-3",
        model=model,
        optimizer=opt,
        scaler=guard,
        extra={"fp8_weight_scales": scales},
    )
    tokens, target = _models.batch(3, 0)
    with torch.no_grad():
        loss = _models.loss_of(model, tokens, target).item()
    return {"scales": scales.scales.tolist(), "loss": loss}
