"""Review r42a's scenarios on 2 ranks (TP + sequence parallel), run in the 2-rank spawn: a param
group added mid-run, grads kept between steps and accumulated, fp16 autocast with growth and
back-off, and a 2-D checkpoint saved by 4 ranks resumed by 2."""

from __future__ import annotations

import copy
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch

from tests.parallel import _meshes


def _gate() -> Any:
    import dscale

    return dscale.StepGuard(
        "cpu", spike_signals=("loss", "grad_norm"), spike_window=2, spike_warmup=2
    )


def _loss(setting: _meshes.Mesh, step: int) -> torch.Tensor:
    out = setting.model(setting.local_batch(_meshes.global_batch(step)))
    return _meshes.local(out).float().square().sum() / setting.loss_share


def late_param(rank: int, world: int) -> dict[str, Any]:
    """The norm's (Partial-grad) params join the optimizer at step 2 (add_param_group): the
    gate's norm against clip_grad_norm_ on the optimizer's params, every step."""
    setting = _meshes.build("tp_sp", rank, world)
    m = setting.model
    opt = torch.optim.SGD([m.w1.weight, m.w1.bias, m.w2.weight, m.w2.bias], lr=0.1)
    guard = _gate()
    gate, true = [], []
    for step in range(4):
        if step == 2:
            opt.add_param_group({"params": [m.norm.weight, m.norm.bias]})
        for p in m.parameters():
            p.grad = None
        guard.scale(_loss(setting, step)).backward()
        params = [p for g in opt.param_groups for p in g["params"]]
        for p in m.parameters():
            if not any(p is q for q in params):
                p.grad = None  # outside the optimizer: not its grad
        true.append(_meshes.true_norm(params))
        guard.step(opt)
        guard.update()
        gate.append(guard.snapshot()["spike_grad_norm"])
    return {"gate": gate, "true": true}


def keep_grads(rank: int, world: int) -> dict[str, Any]:
    """zero_grad(set_to_none=False), 2 microbatches accumulated per step: norm.weight's grad is
    Partial on step 0 and Replicate (summed once, accumulated into) after; the gate's norm is
    clip_grad_norm_'s on every step."""
    setting = _meshes.build("tp_sp", rank, world)
    params = list(setting.model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    guard = _gate()
    gate, true, places = [], [], []
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        for micro in range(2):
            guard.scale(_loss(setting, 2 * step + micro) / 2).backward()
        places.append(str(setting.model.norm.weight.grad.placements))  # type: ignore[union-attr]
        true.append(_meshes.true_norm(params))
        guard.step(opt)
        guard.update()
        gate.append(guard.snapshot()["spike_grad_norm"])
    return {"gate": gate, "true": true, "places": places}


def fp16_autocast(rank: int, world: int) -> dict[str, Any]:
    """autocast fp16 under TP + SP with dscale's GradScaler (init 2^22, growth every step)
    beside the one-process model under torch's scaler: real fp16 overflows back the scale off,
    clean steps grow it; decisions, scales and params must match."""
    import dscale

    setting = _meshes.build("tp_sp", rank, world)
    runs: dict[str, Any] = {}
    oracle = copy.deepcopy(setting.oracle)
    pairs: list[tuple[str, torch.nn.Module, Any, Callable[[torch.Tensor], torch.Tensor]]] = [
        (
            "dscale",
            setting.model,
            dscale.GradScaler("cpu", init_scale=2.0**22, growth_interval=1),
            setting.local_batch,
        ),
        (
            "oracle",
            oracle,
            torch.amp.GradScaler("cpu", init_scale=2.0**22, growth_interval=1),
            lambda x: x,
        ),
    ]
    for label, model, scaler, batch_of in pairs:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scales, applied = [], []
        for step in range(5):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                y = model(batch_of(_meshes.global_batch(step)))
            loss = _meshes.local(y).float().square().sum() / setting.loss_share
            before = [_meshes.local(p).detach().clone() for p in model.parameters()]
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            after = [_meshes.local(p) for p in model.parameters()]
            applied.append(not all(map(torch.equal, before, after)))
            scales.append(scaler.get_scale())
        full = [_meshes.full(p.detach()).clone() for p in model.parameters()]
        runs[label] = {"scales": scales, "applied": applied, "full": full}
    return runs


def resume_four_on_two(rank: int, world: int, root: str) -> dict[str, Any]:
    """The 4-rank spawn's 2-D (FSDP2 x TP) checkpoint of step 2, resumed by 2 ranks on TP + SP
    and on FSDP2 (DCP reshards across world sizes)."""
    from tests.parallel import _ranks

    folder = os.path.join(root, "reshard4")
    out: dict[str, Any] = {}
    for name in ("tp_sp", "fsdp"):
        try:
            steps = range(_ranks.SAVED_AT, _meshes.STEPS)
            out[name] = _ranks._train(name, rank, world, steps, (folder, None))
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


def grads_kept_then_freed(rank: int, world: int) -> dict[str, Any]:
    """A second optimizer takes over while the first one's grads are kept (norm.weight's summed,
    Replicate, accumulated into on its first step); from its second step zero_grad() frees them
    and sequence parallel leaves them Partial again. The check must see the sum (finite pieces
    of 3e38 overflow summed: skipped, scale backed off) and the gate the true norm."""
    import dscale

    setting = _meshes.build("tp_sp", rank, world)
    params = list(setting.model.parameters())
    first = torch.optim.SGD(params, lr=0.1)
    scaler = dscale.GradScaler("cpu", init_scale=1.0, growth_interval=100)
    scaler.scale(_loss(setting, 0)).backward()
    scaler.step(first)  # norm.weight's grad summed: Replicate, kept
    scaler.update()
    second = torch.optim.SGD(params, lr=0.1)
    out: dict[str, Any] = {"placements": []}
    for step in (1, 2):
        if step == 2:
            second.zero_grad()  # set_to_none: the next grad is Partial again
        scaler.scale(_loss(setting, step)).backward()
        grad = setting.model.norm.weight.grad
        out["placements"].append(str(grad.placements))  # type: ignore[union-attr]
        if step == 2:
            _meshes.local(grad).view(-1)[0] = 3e38  # type: ignore[arg-type]
        scaler.step(second)
        scaler.update()
    weight = _meshes.local(setting.model.norm.weight).detach()
    out["finite"] = bool(torch.isfinite(weight).all())
    out["scale"] = scaler.get_scale()
    return out


def attacks(rank: int, world: int) -> dict[str, Any]:
    """Every scenario above but the resume, each one's traceback kept should it raise."""
    out: dict[str, Any] = {}
    for fn in (late_param, keep_grads, fp16_autocast, grads_kept_then_freed):
        try:
            out[fn.__name__] = fn(rank, world)
        except Exception:
            out[fn.__name__] = {"error": traceback.format_exc()}
    return out
