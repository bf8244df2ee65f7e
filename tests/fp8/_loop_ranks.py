"""Rank functions: WeightScales under real training loops (issue 41 items 1-4), with the oracle.

The oracle is computed inside the run, outside the step: before every forward, each rank counts
its shard's elements with ``|w| * scale_used > 448`` (the scale the all-gather casts with), and
the exact scale ``448 / max|w|`` comes from a MAX all-reduce of the shards' amaxes made here, not
by dscale. A sound scale is never above the exact one, so nothing can saturate.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import dscale
import dscale.fp8 as fp8
from tests.fp8 import _fsdp_ranks, _models

FP8_MAX = _fsdp_ranks.FP8_MAX


def _oracle(weights: list[Any]) -> tuple[list[float], list[float], int]:
    """(scales in use, exact scales, saturated elements on this rank's shards)."""
    used = torch.stack([w._local_tensor._precomputed_scale for w in weights]).clone()
    local = [w._local_tensor._tensor for w in weights]
    amax = torch.stack([t.detach().abs().max() for t in local]).double()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)  # the oracle's own collective, outside the step
    saturated = sum(int((t.abs() * s > FP8_MAX).sum()) for t, s in zip(local, used))
    return used.tolist(), (FP8_MAX / amax).tolist(), saturated


def loop(
    rank: int,
    *,
    steps: int = 8,
    lr: float = 1e-2,
    betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.1,
    predict: str = "bound",
    clip: float | None = None,
    betas_from: dict[int, tuple[float, float]] | None = None,
    no_grad_until: dict[str, int] | None = None,
    outward: bool = False,
) -> dict[str, Any]:
    """One FSDP2 float8 all-gather run with WeightScales, the oracle checked before each step.

    ``clip``: torch's AMP clipping recipe (backward, ``unscale_``, ``clip_grad_norm_(clip)``,
    ``step``). ``betas_from``: {step: betas} set on the param group from that step on (a
    schedule). ``no_grad_until``: {parameter name: step}: its grad is dropped before that step
    (a frozen or late parameter: Adam's step count for it lags).
    ``outward``: the float8 weights' grads are replaced by ``-sign(w) * (b2 / b1) ** step``: the
    gradient sequence that reaches Adam's bound (Cauchy-Schwarz holds with equality), so every
    element moves away from zero by exactly ``lr * B(t)``, t its own step count.
    """
    model, conv = _fsdp_ranks.sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
    guard = dscale.StepGuard("cpu")
    scales = fp8.WeightScales(model, opt, guard, conv, predict=predict)
    weights = [w for _, w in _fsdp_ranks._float8_weights(model)]
    named = dict(model.named_parameters())
    out: dict[str, Any] = {"used": [], "exact": [], "saturated": [], "losses": []}
    for step in range(steps):
        used, exact, saturated = _oracle(weights)
        out["used"].append(used)
        out["exact"].append(exact)
        out["saturated"].append(saturated)
        for at, new in sorted((betas_from or {}).items()):
            if step >= at:
                opt.param_groups[0]["betas"] = new
        tokens, target = _models.batch(step, rank)
        loss = _models.loss_of(model, tokens, target)
        guard.scale(loss).backward()
        for name, until in (no_grad_until or {}).items():
            if step < until:
                named[name].grad = None
        if outward:
            beta1, beta2 = opt.param_groups[0]["betas"]
            for w in weights:
                if w.grad is not None:
                    push = -torch.sign(w._local_tensor._tensor) * 1e-3 * (beta2 / beta1) ** step
                    w.grad._local_tensor.copy_(push)
        if clip is not None:
            guard.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        guard.step(opt)
        guard.update()
        opt.zero_grad()
        out["losses"].append(loss.item())
    used, exact, saturated = _oracle(weights)  # after the last step too
    out["used"].append(used)
    out["exact"].append(exact)
    out["saturated"].append(saturated)
    out["predict"] = scales.predict
    return out


def scenarios(rank: int, world: int) -> dict[str, Any]:
    """Every loop of items 1-4 in one spawn (2 gloo ranks)."""
    return {
        # 1. torch's AMP clipping recipe with predict="exact" (and its unclipped control)
        "exact_clip": loop(rank, predict="exact", clip=0.05),
        "exact_noclip": loop(rank, predict="exact"),
        "bound_clip": loop(rank, clip=0.05),
        # 2. a beta2 schedule: (0.9, 0.999) then (0.9, 0.95)
        "betas_schedule": loop(rank, betas=(0.9, 0.999), betas_from={4: (0.9, 0.95)}, steps=8),
        # 3. the group's first parameter (the embedding) gets its first grad late
        "late_first": loop(
            rank,
            betas=(0.9, 0.999),
            weight_decay=0.0,
            no_grad_until={"embed.weight": 8},
            outward=True,
            steps=12,
        ),
        # 3. a float8 weight itself frozen for its first steps (its own count lags)
        "late_float8": loop(
            rank,
            betas=(0.9, 0.999),
            weight_decay=0.0,
            no_grad_until={"blocks.0.fc1.weight": 4},
            outward=True,
            steps=12,
        ),
        # 4. AdamW with lr * weight_decay > 2: decay grows |w|
        "big_decay": loop(rank, lr=1e-2, weight_decay=300.0, steps=5),
    }
