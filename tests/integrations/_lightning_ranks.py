"""Rank functions for test_lightning.py: Fabric and Trainer runs on 2 gloo ranks (one spawn)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.integrations._frameworks import (
    INF_STEP,
    INIT_SCALE,
    STEPS,
    TinyNet,
    batch,
    flat_params,
    framework_env,
    poison,
    poison_after_reduce,
    same_state,
)


def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
    """FSDP2 over the data-parallel mesh dimension (ModelParallelStrategy's parallelize_fn)."""
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh["data_parallel"]
    fully_shard(model.fc1, mesh=dp_mesh)
    fully_shard(model.fc2, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def _hidden_dtype(model: Any) -> Any:
    inner = model.module if hasattr(model, "module") else model
    inner = inner.module if hasattr(inner, "module") else inner
    return inner.hidden_dtype


def _fabric(strategy: Any, plugin: Any) -> Any:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()
    return fabric


def _fabric_run(rank: int, tmp: str, arm: str) -> dict[str, Any]:
    """Train STEPS steps with Fabric; save, then load into a fresh scaler."""
    from lightning.fabric.plugins.precision import MixedPrecision as LightningMixed
    from lightning.fabric.strategies import ModelParallelStrategy as LightningMP

    import dscale
    from dscale.integrations import fabric as dscale_fabric

    topology, kind = arm.split("-")
    if kind == "dscale":
        scaler: Any = dscale.GradScaler("cpu", init_scale=INIT_SCALE)
        plugin: Any = dscale_fabric.MixedPrecision(scaler)
        fresh: Any = dscale.GradScaler("cpu")
    else:  # Lightning's own plugin with torch's scaler
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        plugin = LightningMixed("16-mixed", "cpu", scaler=scaler)
        fresh = torch.amp.GradScaler("cpu")
    if topology == "ddp":
        strategy: Any = "ddp"
    else:
        fix = dscale_fabric.ModelParallelStrategy if kind == "dscale" else LightningMP
        strategy = fix(parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = _fabric(strategy, plugin)
    model = fabric.setup_module(TinyNet())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01, fused=True))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.9**i)
    rows = []
    for step in range(STEPS):
        loss = model(batch(rank, step)).float().square().mean()
        fabric.backward(loss)
        if rank == 1 and step == INF_STEP:
            poison(model)
        if kind == "dscale":  # Lightning's plugin refuses to clip with a fused optimizer
            fabric.clip_gradients(model, opt, max_norm=10.0, error_if_nonfinite=False)
        opt.step()
        opt.zero_grad()
        if kind == "torch" or scaler.step_applied():  # torch's cannot tell for fused steps
            sched.step()
        rows.append(
            {
                "scale": scaler.get_scale(),
                "sched": sched.last_epoch,
                "params": flat_params(model),
                "hidden": _hidden_dtype(model),
            }
        )
    fabric.save(f"{tmp}/fabric-{arm}", {"model": model, "optimizer": opt, "scaler": scaler})
    state = {"model": model, "optimizer": opt, "scaler": fresh}
    fabric.load(f"{tmp}/fabric-{arm}", state)
    return {
        "rows": rows,
        "saved": scaler.state_dict(),
        "loaded": fresh.state_dict(),
        "scaler_in_state": type(state["scaler"]).__name__,
    }


def _fabric_fsdp1_run(rank: int, tmp: str, strategy_from: str) -> dict[str, Any]:
    """Fabric's FSDPStrategy (FSDP1) with dscale's FSDPPrecision; a sharded save and load.

    ``strategy_from`` "dscale" is dscale_fabric.FSDPStrategy; "lightning" is Lightning's own,
    through a subclass that changes nothing but passes Fabric's CPU check (``type(strategy) is
    FSDPStrategy`` needs CUDA). The module is wrapped before setup_module, since Fabric's own
    wrapping names no device, which torch's FSDP1 refuses on the CPU.
    """
    from lightning.fabric.strategies import FSDPStrategy as LightningFSDP
    from torch.distributed.fsdp import FullyShardedDataParallel

    import dscale
    from dscale.integrations import fabric as dscale_fabric

    class CPUFSDPStrategy(LightningFSDP):  # type: ignore[misc]
        pass

    kind = dscale_fabric.FSDPStrategy if strategy_from == "dscale" else CPUFSDPStrategy
    scaler = dscale.GradScaler("cpu", init_scale=INIT_SCALE)
    fabric = _fabric(kind(state_dict_type="sharded"), dscale_fabric.FSDPPrecision(scaler))
    wrapped = FullyShardedDataParallel(TinyNet(), device_id=torch.device("cpu"))
    model = fabric.setup_module(wrapped)
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.9**i)
    rows = []
    for step in range(STEPS):
        with fabric.autocast():
            loss = model(batch(rank, step)).float().square().mean()
        fabric.backward(loss)
        if rank == 1 and step == INF_STEP:
            poison(model)
        fabric.clip_gradients(model, opt, max_norm=10.0)
        opt.step()
        opt.zero_grad()
        if scaler.step_applied():
            sched.step()
        with FullyShardedDataParallel.summon_full_params(wrapped):
            params = flat_params(wrapped)
        rows.append(
            {
                "scale": scaler.get_scale(),
                "sched": sched.last_epoch,
                "params": params,
                "hidden": wrapped.module.hidden_dtype,
            }
        )
    path = f"{tmp}/fabric-fsdp1-{strategy_from}"
    fabric.save(path, {"model": model, "optimizer": opt, "scaler": scaler})
    fresh = dscale.GradScaler("cpu")
    state = {"model": model, "optimizer": opt, "scaler": fresh}
    fabric.load(path, state)
    return {
        "rows": rows,
        "saved": scaler.state_dict(),
        "loaded": fresh.state_dict(),
        "scaler_in_state": type(state["scaler"]).__name__,
    }


def _fabric_master_weights_run(rank: int, tmp: str) -> dict[str, Any]:
    from dscale.integrations import fabric as dscale_fabric

    precision = dscale_fabric.MasterWeightsPrecision({"init_scale": INIT_SCALE})
    fabric = _fabric("ddp", precision)
    model = fabric.setup_module(TinyNet())
    opt = fabric.setup_optimizers(precision.wrap(torch.optim.SGD(model.parameters(), lr=0.05)))
    current = {"step": -1}
    poison_after_reduce(model._forward_module, lambda: rank == 1 and current["step"] == INF_STEP)
    rows = []
    for step in range(STEPS):
        current["step"] = step
        loss = model(batch(rank, step).half()).float().square().mean()
        fabric.backward(loss)  # checks the grads: the inf must come from inside the reduction
        opt.step()
        opt.zero_grad()
        fp16 = precision.fp16_optimizer(opt)
        rows.append(
            {
                "skipped": fp16.overflow,
                "scale": fp16.loss_scale,
                "params": flat_params(model),
                "dtype": next(model.parameters()).dtype,
            }
        )
    fabric.save(f"{tmp}/fabric-masters", {"model": model, "precision": precision})
    again = dscale_fabric.MasterWeightsPrecision()
    again.wrap(torch.optim.SGD(TinyNet().half().parameters(), lr=0.05))
    fabric.load(f"{tmp}/fabric-masters", {"model": model, "precision": again})
    saved, loaded = precision.state_dict(), again.state_dict()
    return {
        "rows": rows,
        "loaded_equals_saved": same_state(saved, loaded),
        "scaler": saved["fp16_optimizers"][0]["scaler"],
        "masters_are_fp32": saved["fp16_optimizers"][0]["fp32_from_fp16"][0][0].dtype,
    }


def lightning_checks(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    framework_env(rank, world_size)
    out: dict[str, Any] = {}
    for arm in ("ddp-dscale", "ddp-torch", "fsdp2-dscale", "fsdp2-torch"):
        out[f"fabric-{arm}"] = _fabric_run(rank, tmp, arm)
    out["fabric-fsdp1-dscale"] = _fabric_fsdp1_run(rank, tmp, "dscale")
    out["fabric-fsdp1-lightning"] = _fabric_fsdp1_run(rank, tmp, "lightning")
    out["fabric-masters"] = _fabric_master_weights_run(rank, tmp)
    from tests.integrations._lightning_trainer import trainer_checks

    out.update(trainer_checks(rank, tmp))
    return out
