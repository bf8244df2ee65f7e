"""Rank functions for the MXFP8 tests: dscale's conversion against torchao's MXFP8Linear alone."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import dscale
import dscale.fp8 as fp8
from tests.fp8 import _models

LINEARS = ("blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2")


def torchao_mxfp8(model: nn.Module, recipe: str, names: tuple[str, ...] = LINEARS) -> nn.Module:
    """The oracle: ``model``'s block linears replaced by hand with torchao's own MXFP8Linear."""
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.quantization.quantize_.common import KernelPreference

    for name in names:
        block, _, fc = name.rpartition(".")
        old = model.get_submodule(name)
        new = MXFP8Linear(
            old.in_features,
            old.out_features,
            kernel_preference=KernelPreference.EMULATED,
            wgrad_with_hp=recipe == "mxfp8_wgrad_with_hp",
        )
        new.load_state_dict(old.state_dict())
        setattr(model.get_submodule(block), fc, new)
    return model


def build(arm: str, recipe: str) -> nn.Module:
    """The test model, MXFP8 by dscale's one call (``arm="dscale"``) or by hand (``"torchao"``)."""
    model = _models.net()
    if arm == "dscale":
        fp8.convert_to_float8(model, recipe=recipe, emulate=True)  # type: ignore[arg-type]
        return model
    return torchao_mxfp8(model, recipe)


def train(
    rank: int,
    arm: str,
    recipe: str,
    parallel: str = "single",
    *,
    steps: int = 3,
    inf_step: int | None = None,
) -> dict[str, Any]:
    """Losses (and final params) of ``arm`` under bf16 autocast, AdamW.

    dscale's arm steps through a StepGuard (which agrees skips); torchao's arm is a plain loop
    (``opt.step()``), the reference a guard must not change while nothing overflows.
    ``inf_step``: rank 1 puts an inf into its first grad at that step (dscale's arm only).
    """
    model = build(arm, recipe)
    if parallel == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif parallel == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mp_policy=bf16)  # bf16 all-gather
        fully_shard(model, mp_policy=bf16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = dscale.StepGuard("cpu") if arm == "dscale" else None
    losses, skipped = [], []
    for step in range(steps):
        tokens, target = _models.batch(step, rank)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _models.loss_of(model, tokens, target)
        losses.append(loss.item())
        if guard is None:
            loss.backward()
            opt.step()
        else:
            guard.scale(loss).backward()
            if step == inf_step and rank == 1:
                next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float(
                    "inf"
                )
            guard.step(opt)
            guard.update()
            skipped.append(guard.snapshot()["skipped_steps"])
        opt.zero_grad()
    params = {n: _full(p).clone() for n, p in model.named_parameters()}
    return {"losses": losses, "skipped": skipped, "params": params}


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def ranks(rank: int, world_size: int) -> dict[str, Any]:
    """Every multi-rank scenario in one spawn: DDP with mxfp8 and FSDP2 (bf16 all-gather)
    with mxfp8_wgrad_with_hp against torchao alone (FSDP2 with mxfp8 is the benchmark arm's
    run in the same spawn; each recipe is checked alone on one process), and an inf on rank 1
    under DDP. (Both recipes under both wrappers took twice the time: r43a.)"""
    out: dict[str, Any] = {}
    for parallel, recipe in (("ddp", "mxfp8"), ("fsdp2", "mxfp8_wgrad_with_hp")):
        key = f"{parallel}/{recipe}"
        out[key] = {arm: train(rank, arm, recipe, parallel) for arm in ("dscale", "torchao")}
    out["inf"] = train(rank, "dscale", "mxfp8", "ddp", steps=3, inf_step=1)
    return out


def mismatched(rank: int, world_size: int) -> dict[str, Any]:
    """Float8Numerics' construction where rank 1 converted otherwise than rank 0: another
    recipe (tensorwise), the wgrad variant of MXFP8, a layer left in high precision. Each
    scenario's error (type name, message) on this rank, or None; the same step after."""
    rank_1 = {
        "tensorwise": {"recipe": "tensorwise"},
        "wgrad": {"recipe": "mxfp8_wgrad_with_hp"},
        "kept": {"recipe": "mxfp8", "keep_high_precision": ["blocks.0.fc1"]},
    }
    out: dict[str, Any] = {}
    for key, other in rank_1.items():
        model = _models.net()
        kwargs = other if rank == 1 else {"recipe": "mxfp8"}
        fp8.convert_to_float8(model, emulate=True, **kwargs)  # type: ignore[arg-type]
        try:
            fp8.Float8Numerics(model, dscale.StepGuard("cpu")).close()
            out[key] = None
        except ValueError as e:
            out[key] = (type(e).__name__, str(e))
    return out
