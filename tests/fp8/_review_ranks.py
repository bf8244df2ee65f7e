"""Rank functions: the issue 41 review's attacks on WeightScales under training loops.

The oracle is the one of ``_loop_ranks``: before every forward, each rank counts its shards'
elements with ``|w| * scale_used > 448``, and the exact scale ``448 / max|w|`` comes from the
test's own MAX all-reduce, made outside the step.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import dscale
import dscale.fp8 as fp8
from dscale.checkpoint import CheckpointError, CheckpointManager
from tests.fp8 import _fsdp_ranks, _models
from tests.fp8._loop_ranks import _oracle


def _record(out: dict[str, Any], weights: list[Any]) -> None:
    used, exact, saturated = _oracle(weights)
    out["used"].append(used)
    out["exact"].append(exact)
    out["saturated"].append(saturated)


def schedule_loop(rank: int, *, predict: str, variant: str) -> dict[str, Any]:
    """torch's AMP recipe with everything a real loop changes in one run: clipping, a beta
    schedule changed on the step an inf is injected (rank 1 only: every rank skips), an lr
    schedule run past its end (lr < 0), eps and decay changed, a param group added later,
    zero_grad(set_to_none=False) on some steps, a float8 weight without grad for 2 steps."""
    model, conv = _fsdp_ranks.sharded()
    params = list(model.parameters())
    if variant == "adamw":
        opt: Any = torch.optim.AdamW(params, lr=2e-2, betas=(0.9, 0.999), weight_decay=0.1)
    else:  # Adam with L2 decay, amsgrad and maximize, single-tensor
        opt = torch.optim.Adam(
            params,
            lr=2e-2,
            betas=(0.9, 0.999),
            weight_decay=0.1,
            amsgrad=True,
            maximize=True,
            foreach=False,
        )
    guard = dscale.StepGuard("cpu")
    scales = fp8.WeightScales(model, opt, guard, conv, predict=predict)
    weights = [w for _, w in _fsdp_ranks._float8_weights(model)]
    named = dict(model.named_parameters())
    out: dict[str, Any] = {"used": [], "exact": [], "saturated": [], "skipped": []}
    extra = torch.nn.Parameter(torch.zeros(3))
    for step in range(10):
        _record(out, weights)
        group = opt.param_groups[0]
        group["lr"] = 2e-2 * (1 - step / 6)  # a linear decay run past its end: lr < 0 from 7
        if step == 3:
            group["betas"] = (0.5, 0.6)
        if step == 4:
            group["betas"], group["eps"] = (0.9, 0.95), 1e-3
            opt.add_param_group({"params": [extra], "lr": 1e-3})
        if step == 7:
            group["weight_decay"] = 0.5
        tokens, target = _models.batch(step, rank)
        loss = _models.loss_of(model, tokens, target)
        guard.scale(loss).backward()
        if step in (5, 6):
            named["blocks.1.fc2.weight"].grad = None
        if step == 3 and rank == 1:
            named["blocks.0.fc1.weight"].grad._local_tensor.view(-1)[0] = float("inf")
        guard.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        guard.step(opt)
        out["skipped"].append(not guard.step_applied(opt))
        guard.update()
        opt.zero_grad(set_to_none=step % 2 == 0)
    _record(out, weights)
    out["lr"] = opt.param_groups[0]["lr"]
    out["measured"] = scales.num_measured
    return out


def rollback(rank: int) -> dict[str, Any]:
    """A rollback to an earlier snapshot (a loss spike: PaLM's recipe) with torch's own
    state-dict API, model and optimizer, without the WeightScales state; strong decay, so the
    snapshot's weights are larger than the current ones."""
    model, conv = _fsdp_ranks.sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=40.0)
    guard = dscale.StepGuard("cpu")
    fp8.WeightScales(model, opt, guard, conv)
    weights = [w for _, w in _fsdp_ranks._float8_weights(model)]
    out: dict[str, Any] = {"used": [], "exact": [], "saturated": []}
    snapshot = None
    for step in range(8):
        if step == 2:
            snapshot = copy.deepcopy(
                (get_model_state_dict(model), get_optimizer_state_dict(model, opt))
            )
        if step == 5:
            assert snapshot is not None
            set_model_state_dict(model, snapshot[0])
            set_optimizer_state_dict(model, opt, snapshot[1])
        _record(out, weights)
        tokens, target = _models.batch(step, rank)
        guard.scale(_models.loss_of(model, tokens, target)).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
    _record(out, weights)
    return out


def other_object(rank: int, directory: str) -> dict[str, Any]:
    """extra={'fp8_weight_scales': <not the scaler's WeightScales>} at save: refused on every
    rank, nothing written."""
    model, conv = _fsdp_ranks.sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = dscale.StepGuard("cpu")
    fp8.WeightScales(model, opt, guard, conv)
    impostor = torch.nn.Linear(2, 2)
    try:
        CheckpointManager(directory, every=0).save(
            1, model=model, optimizer=opt, scaler=guard, extra={"fp8_weight_scales": impostor}
        )
        refusal = "no error"
    except (CheckpointError, ValueError) as exc:
        refusal = f"{type(exc).__name__}: {exc}"
    return {"refusal": refusal, "written": sorted(os.listdir(directory))}


def attacks(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Every attack in one spawn (2 gloo ranks)."""
    return {
        "exact_adamw": schedule_loop(rank, predict="exact", variant="adamw"),
        "bound_adamw": schedule_loop(rank, predict="bound", variant="adamw"),
        "bound_amsgrad": schedule_loop(rank, predict="bound", variant="amsgrad"),
        "rollback": rollback(rank),
        "other_object": other_object(rank, directory),
    }
