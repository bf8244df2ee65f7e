"""Rank functions for the FSDP2 float8 all-gather tests (imported by spawned ranks)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard

import dscale
import dscale.fp8 as fp8
from tests.fp8 import _models

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def allreduces_in(fn) -> int:
    """all-reduces ``fn()`` dispatches (FSDP's all-gathers and reduce-scatters are other ops)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "c10d::allreduce_")


def sharded(keep: list[str] | None = None) -> tuple[torch.nn.Module, Any]:
    model = _models.net()
    conv = fp8.convert_to_float8(
        model, float8_all_gather=True, keep_high_precision=keep, emulate=True
    )
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, conv


def _float8_weights(model):
    from torchao.float8.float8_linear import Float8Linear

    return [(n, m.weight) for n, m in sorted(model.named_modules()) if isinstance(m, Float8Linear)]


def train(
    rank: int,
    arm: str,
    *,
    steps: int = 8,
    lr: float = 3e-3,
    betas: tuple[float, float] = (0.9, 0.95),
    optimizer: str = "adamw",
    nan_steps: tuple[int, ...] = (),
    numerics: bool = False,
    predict: str = "bound",
) -> dict[str, Any]:
    """One run of ``arm`` ("ao": torchao's precompute after each step; "dscale": WeightScales).

    ``numerics``: a Float8Numerics sampling every step rides the same vector after the scales.
    """
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    model, conv = sharded()
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    guard = dscale.StepGuard("cpu")
    scales = None
    if arm == "dscale":
        scales = fp8.WeightScales(model, opt, guard, conv, predict=predict)
        if numerics:
            fp8.Float8Numerics(model, guard, every=1)
    else:
        precompute_float8_dynamic_scale_for_fsdp(model)
    weights = _float8_weights(model)
    out: dict[str, Any] = {"losses": [], "scales": [], "amax": [], "saturated": 0, "skipped": []}

    def one_step(step: int) -> None:
        tokens, target = _models.batch(step, rank)
        loss = _models.loss_of(model, tokens, target)
        guard.scale(loss).backward()
        if step in nan_steps and rank == 1:
            next(iter(model.parameters())).grad._local_tensor.view(-1)[0] = math.nan
        guard.step(opt)
        guard.update()
        opt.zero_grad()
        if arm == "ao":
            precompute_float8_dynamic_scale_for_fsdp(model)
        out["losses"].append(loss.item())
        out["skipped"].append(not guard.step_applied(opt))

    for step in range(steps):
        # The scales the next forward casts with, and this rank's part of the exact amax.
        used = torch.stack([w._local_tensor._precomputed_scale for _, w in weights]).clone()
        local = [w._local_tensor._tensor for _, w in weights]
        amax = torch.stack([t.abs().max() for t in local])
        out["scales"].append(used.tolist())
        out["amax"].append(amax.tolist())
        out["saturated"] += sum(int((t.abs() * s > FP8_MAX).sum()) for t, s in zip(local, used))
        if step == steps - 2:
            out["allreduces"] = allreduces_in(lambda s=step: one_step(s))
        else:
            one_step(step)
    out["nonfinite"] = None if scales is None else scales.num_nonfinite
    return out


def layouts_differ(rank: int) -> str:
    """Rank 1 keeps blocks.1 in high precision: WeightScales must fail on both ranks."""
    model, conv = sharded(keep=["blocks.1"] if rank == 1 else None)
    opt = torch.optim.AdamW(model.parameters())
    try:
        fp8.WeightScales(model, opt, dscale.StepGuard("cpu"), conv)
    except fp8.LayoutMismatchError as exc:
        return str(exc)
    return "no error"


def ddp(rank: int, guarded: bool) -> dict[str, Any]:
    """A float8 model under DDP, with a StepGuard or none (the oracle), 4 steps."""
    from torch.nn.parallel import DistributedDataParallel

    model = _models.net()
    fp8.convert_to_float8(model, emulate=True)
    wrapped = DistributedDataParallel(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=3e-3)
    guard = dscale.StepGuard("cpu") if guarded else None
    losses = []
    for step in range(4):
        tokens, target = _models.batch(step, rank)
        loss = _models.loss_of(wrapped, tokens, target)
        if guard is None:
            loss.backward()
            opt.step()
        else:
            guard.scale(loss).backward()
            guard.step(opt)
            guard.update()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def numerics_worst_rank(rank: int) -> dict[str, Any]:
    """DDP, Float8Numerics every step; an outlier enters blocks.0.fc1 on rank 1 only."""
    from torch.nn.parallel import DistributedDataParallel

    model = _models.net()
    fp8.convert_to_float8(model, emulate=True)
    if rank == 1:

        def blow_up(module, args):
            bump = torch.zeros_like(args[0])
            bump[0, 0, 0] = args[0].detach().abs().max() * 1e4
            return (args[0] + bump,)

        model.blocks[0].fc1.register_forward_pre_hook(blow_up)
    wrapped = DistributedDataParallel(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    guard = dscale.StepGuard("cpu")
    numerics = fp8.Float8Numerics(wrapped, guard, every=1)
    tokens, target = _models.batch(0, rank)
    guard.scale(_models.loss_of(wrapped, tokens, target)).backward()
    guard.step(opt)
    guard.update()
    return numerics.snapshot()


def fallback_agreed(rank: int) -> dict[str, Any]:
    """DDP; an outlier enters blocks.0.fc1 on rank 1 only; Float8Fallback after 2 samples."""
    from torch.nn.parallel import DistributedDataParallel

    model = _models.net()
    fp8.convert_to_float8(model, emulate=True)
    if rank == 1:

        def blow_up(module, args):
            bump = torch.zeros_like(args[0])
            bump.view(-1)[0] = args[0].detach().abs().max() * 1e4
            return (args[0] + bump,)

        model.blocks[0].fc1.register_forward_pre_hook(blow_up)
    wrapped = DistributedDataParallel(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    guard = dscale.StepGuard("cpu")
    numerics = fp8.Float8Numerics(wrapped, guard, every=1)
    fallback = fp8.Float8Fallback(numerics, guard, threshold=0.05, samples=2)
    fell = []
    for step in range(3):
        tokens, target = _models.batch(step, rank)
        guard.scale(_models.loss_of(wrapped, tokens, target)).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
        fell.append(list(fallback.fallen))
    return {"fell": fell, "params": [p.detach().clone() for p in model.parameters()]}


def scenarios(rank: int, world: int) -> dict[str, Any]:
    return {
        "fallback": fallback_agreed(rank),
        "numerics": numerics_worst_rank(rank),
        "ddp_plain": ddp(rank, guarded=False),
        "ddp_guard": ddp(rank, guarded=True),
        "ao": train(rank, "ao"),
        "dscale": train(rank, "dscale"),
        "dscale_numerics": train(rank, "dscale", numerics=True),
        "dscale_exact": train(rank, "dscale", betas=(0.9, 0.999), predict="exact"),
        "exact_nan": train(rank, "dscale", lr=1e-2, nan_steps=(3,), predict="exact"),
        "ao_nan": train(rank, "ao", lr=1e-2, nan_steps=(3,)),
        "dscale_nan": train(rank, "dscale", lr=1e-2, nan_steps=(3,)),
        "sgd": train(rank, "dscale", optimizer="sgd", lr=1e-2),
        "sgd_ao": train(rank, "ao", optimizer="sgd", lr=1e-2),
        "layouts": layouts_differ(rank),
    }
