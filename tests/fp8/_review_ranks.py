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
    os.makedirs(directory, exist_ok=True)
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
        "other_object": other_object(rank, f"{directory}/other"),
        "two_models": two_models(rank, world, f"{directory}/two"),
        # last: the 1-rank resume test (its own spawn) loads this checkpoint
        "save_two": save_two(rank, world, f"{directory}/resume"),
    }


def _resume_build():
    model, conv = _fsdp_ranks.sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1)
    guard = dscale.StepGuard("cpu")
    scales = fp8.WeightScales(model, opt, guard, conv)
    return model, opt, guard, scales, [w for _, w in _fsdp_ranks._float8_weights(model)]


def _train(rank, model, opt, guard, weights, steps, out):
    for step in steps:
        if step == 3:  # a beta schedule: the resume lands in the middle of it
            opt.param_groups[0]["betas"] = (0.9, 0.95)
        _record(out, weights)
        tokens, target = _models.batch(step, rank)
        guard.scale(_models.loss_of(model, tokens, target)).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
    _record(out, weights)


def save_two(rank: int, world: int, directory: str) -> dict[str, Any]:
    """2 ranks: 4 steps (betas changed at step 3), saved at step 4; the run goes on to 7."""
    model, opt, guard, scales, weights = _resume_build()
    out: dict[str, Any] = {"used": [], "exact": [], "saturated": []}
    _train(rank, model, opt, guard, weights, range(4), out)
    CheckpointManager(directory, every=0).save(4, model=model, optimizer=opt, scaler=guard)
    out["saved"] = scales.state_dict()
    return out


def resume_one(rank: int, world: int, directory: str) -> dict[str, Any]:
    """1 rank resumes the 2-rank checkpoint and trains 4 more steps (its own batches)."""
    from dscale.checkpoint import load_checkpoint

    torch.manual_seed(1)
    model, opt, guard, scales, weights = _resume_build()
    step = load_checkpoint(f"{directory}/step-4", model=model, optimizer=opt, scaler=guard)
    out: dict[str, Any] = {"used": [], "exact": [], "saturated": [], "loaded": scales.state_dict()}
    _train(rank, model, opt, guard, weights, range(step, step + 4), out)
    out["measured"] = scales.num_measured
    return out


def two_models(rank: int, world: int, directory: str) -> dict[str, Any]:
    """torch's multi-model recipe on one scaler: two FSDP2 float8 models, a WeightScales each.
    Only one travels under 'fp8_weight_scales': the save must refuse, or take both by name."""
    (one, conv1), (two, conv2) = _fsdp_ranks.sharded(), _fsdp_ranks.sharded()
    guard = dscale.StepGuard("cpu")
    opt1 = torch.optim.AdamW(one.parameters(), lr=1e-2)
    opt2 = torch.optim.AdamW(two.parameters(), lr=1e-2)
    ws1 = fp8.WeightScales(one, opt1, guard, conv1)
    ws2 = fp8.WeightScales(two, opt2, guard, conv2)
    tokens, target = _models.batch(0, rank)
    guard.scale(
        _models.loss_of(one, tokens, target) + _models.loss_of(two, tokens, target)
    ).backward()
    guard.step(opt1)
    guard.step(opt2)
    guard.update()
    out: dict[str, Any] = {}
    try:
        CheckpointManager(f"{directory}/auto", every=0).save(
            1, model=one, optimizer=opt1, scaler=guard
        )
        out["refusal"] = "no error"
    except (CheckpointError, ValueError) as exc:
        out["refusal"] = f"{type(exc).__name__}: {exc}"
    out["written"] = (
        sorted(os.listdir(f"{directory}/auto")) if os.path.isdir(f"{directory}/auto") else []
    )
    CheckpointManager(f"{directory}/named", every=0).save(
        1, model=one, optimizer=opt1, scaler=guard, extra={"ws_one": ws1, "ws_two": ws2}
    )
    out["named"] = sorted(os.listdir(f"{directory}/named"))
    return out
