"""The rank functions: one spawn per world size runs every setting and scaler of that size."""

from __future__ import annotations

import math
import os
import traceback
from typing import Any

import torch

from tests.parallel import _meshes

#: world size -> the settings run on it
SETTINGS = {2: ("tp", "tp_sp"), 4: ("fsdp_tp", "hsdp")}
#: world size -> (the mesh a checkpoint is saved on, the mesh it resumes on)
RESHARDS = {2: ("tp_sp", "fsdp"), 4: ("fsdp_tp", "hsdp")}
#: settings run only for the table (torch's scaler and dscale's): their mesh is run in full as well
CONTROLS = ("tp",)
SAVED_AT = 2  # the checkpoint holds steps 0-1; the continuation runs the inf step and one more


def _dscale(**kwargs: Any) -> Any:
    import dscale

    kwargs = {"init_scale": 2.0**10, "growth_interval": 1, **kwargs}
    return dscale.GradScaler("cpu", **kwargs)


def _on_device(scaler: Any) -> Any:
    """sync_free decided on the device (masked step, device-side update), as on CUDA: on the CPU
    the scaler would read the agreed flag in host memory instead."""
    from dscale.bench._ops import force_device_decision

    force_device_decision(scaler)
    return scaler


def _attached(model: torch.nn.Module) -> Any:
    scaler = _dscale()
    scaler.attach(model)
    return scaler


def _scalers(world: int) -> dict[str, Any]:
    import dscale

    scalers = {
        "torch": lambda _: torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1),
        "dscale": lambda _: _dscale(),
        "dscale_sync_free": lambda _: _on_device(_dscale(sync_free=True)),
        "dscale_predictive": lambda _: _dscale(policy="predictive"),
        "step_guard_gate": lambda _: dscale.StepGuard(
            "cpu", spike_signals=("loss", "grad_norm"), spike_window=2, spike_warmup=2
        ),
    }
    if world == 4:  # FSDP2 x TP and HSDP are fully_shard models: attach() applies
        scalers["dscale_attach"] = _attached
    return scalers


def run_settings(rank: int, world_size: int, root: str | None = None) -> dict[str, Any]:
    """Every setting of this world size under every scaler, the oracle beside each; then the
    extra scenarios (attach() where it does not apply, Partial pieces that overflow only when
    summed, a checkpoint saved on one mesh and resumed on another) when ``root`` is given."""
    out: dict[str, Any] = {}
    for name in SETTINGS[world_size]:
        for first in (True, False) if name == "tp" else (False,):
            key = f"{name}_replicated_first" if first else name
            out[key] = {"oracle": _meshes.run_oracle(_meshes.build(name, rank, world_size), first)}
            for label, make in _scalers(world_size).items():
                if key in CONTROLS and label not in ("torch", "dscale"):
                    continue
                setting = _meshes.build(name, rank, world_size)
                write = label != "dscale_attach"
                out[key][label] = _meshes.run(setting, rank, make, first=first, write_grads=write)
            built = _meshes.build(name, rank, world_size)
            out[key]["replicas"] = (built.replicas, built.replica_key)
    if world_size == 2:
        out["attach_tp"] = _attach_refused(rank, world_size)
        out["partial_overflow"] = _partial_overflow(rank, world_size)
    if root is not None:
        out["reshard"] = _reshard(rank, world_size, root)
    return out


def _attach_refused(rank: int, world: int) -> str:
    """attach() on a TP model (parallelize_module, neither DDP nor FSDP2): the error's text."""
    setting = _meshes.build("tp_sp", rank, world)
    try:
        _dscale().attach(setting.model)
    except TypeError as exc:
        return str(exc)
    return "accepted"


def _partial_overflow(rank: int, world: int) -> dict[str, Any]:
    """Each rank's Partial piece of norm.weight's grad is finite (3e38), their sum is inf: the
    check must see the sum (as with fp16 pieces near 65504). Torch's scaler beside it checks
    the pieces, steps, and the optimizer's own sum writes inf into the weight. A clean step
    before it counts the step's collectives (the optimizer's included) under both scalers."""
    from torch.distributed.tensor.debug import CommDebugMode

    out: dict[str, Any] = {}
    for label in ("dscale", "torch"):
        setting = _meshes.build("tp_sp", rank, world)
        params = _meshes.params_of(setting.model, False)
        opt = torch.optim.SGD(params, lr=0.1)
        scaler = (  # at a scale of 1 the unscaled pieces are the pieces
            _dscale(init_scale=1.0, growth_interval=100)
            if label == "dscale"
            else torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=100)
        )
        counts = []
        for step in range(2):
            opt.zero_grad()
            out_t = setting.model(setting.local_batch(_meshes.global_batch(step)))
            scaler.scale(_meshes.local(out_t).square().sum() / setting.loss_share).backward()
            grad = setting.model.norm.weight.grad
            placements = str(grad.placements)
            if step == 1:
                _meshes.local(grad).view(-1)[0] = 3e38
            with CommDebugMode() as comms:  # the step's collectives, the optimizer's included
                scaler.step(opt)
                scaler.update()
            counts.append(comms.get_total_counts())
        weight = _meshes.local(setting.model.norm.weight).detach()
        out[label] = {
            "grad_placements": placements,
            "finite": bool(torch.isfinite(weight).all()),
            "scale": scaler.get_scale(),
            "clean_step_collectives": counts[0],
        }
    return out


def _train(name: str, rank: int, world: int, steps: range, state: Any = None) -> dict[str, Any]:
    """A fresh ``name`` model, optionally resumed from ``state`` = (manager, folder), over
    ``steps``; returns its full params, scaler state and optimizer state's full momenta."""
    from dscale.checkpoint import CheckpointManager

    setting = _meshes.build(name, rank, world)
    params = _meshes.params_of(setting.model, False)
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    scaler = _dscale()
    root, save_at = state
    manager = CheckpointManager(root, every=0, keep=3)
    if steps.start > 0:
        resumed = manager.resume("auto", model=setting.model, optimizer=opt, scaler=scaler)
        assert resumed == steps.start, resumed
    result = _meshes.run(setting, rank, None, first=False, steps=steps, opt=opt, scaler=scaler)
    if save_at is not None:
        manager.save(save_at, model=setting.model, optimizer=opt, scaler=scaler)
        manager.wait()
    momenta = [_meshes.full(opt.state[p]["momentum_buffer"]).clone() for p in params]
    return {**result, "scaler": scaler.state_dict(), "momenta": momenta}


def _reshard(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save on RESHARDS[world][0] after SAVED_AT steps; resume there (the reduction order is the
    same: bitwise) and on RESHARDS[world][1] (another order: fp32 rounding); the uninterrupted
    run of the saving mesh is the reference."""
    saved_on, resumed_on = RESHARDS[world]
    folder = os.path.join(root, f"reshard{world}")
    out: dict[str, Any] = {"meshes": (saved_on, resumed_on)}
    try:
        out["whole"] = _train(saved_on, rank, world, range(_meshes.STEPS), (folder + "w", None))
        _train(saved_on, rank, world, range(SAVED_AT), (folder, SAVED_AT))
        rest = range(SAVED_AT, _meshes.STEPS)
        out["same_mesh"] = _train(saved_on, rank, world, rest, (folder, None))
        out["other_mesh"] = _train(resumed_on, rank, world, rest, (folder, None))
    except Exception:
        out["error"] = traceback.format_exc()
    out["nonfinite"] = not all(
        math.isfinite(float(t.abs().max())) for t in out.get("other_mesh", {}).get("full", [])
    )
    return out
