"""Attacks on pipeline_loss() (review r42b), run inside one 2-rank spawn; see test_pipeline_attacks.

Each scenario returns what it saw on this rank; the oracles are the one-process runs of
``tests/parallel/_pp.py`` (the same model, batches and microbatching).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

import dscale
from tests.parallel import _pp
from tests.parallel._pp import batch, first_weight, mse, params_of, stage_modules


def schedule(modules: list[Any], rank: int, world: int, loss_fn: Any, n: int) -> Any:
    """A GPipe schedule over the 2-stage split with ``n`` microbatches (a new one infers shapes)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage = PipelineStage(modules[0], rank, world, torch.device("cpu"))
    return ScheduleGPipe(stage, n_microbatches=n, loss_fn=loss_fn)


def _run(sched: Any, rank: int, step: int) -> None:
    x, y = batch(step)
    sched.step(x, target=y) if rank == 0 else sched.step(target=y)


def gate() -> dscale.StepGuard:
    return dscale.StepGuard("cpu", spike_signals=("loss",), spike_window=8, spike_warmup=3)


def kept_dummy_scale(rank: int, world: int) -> list[float]:
    """pipeline_loss() with the old workaround kept: the loss-less stage still calls
    ``scale(torch.zeros(()))`` each iteration. The gate's loss, per step."""
    guard = gate()
    modules = stage_modules("gpipe", rank, world)
    opt = torch.optim.SGD(modules[0].parameters(), lr=0.1)
    sched = schedule(modules, rank, world, guard.pipeline_loss(mse), _pp.MICROBATCHES)
    losses = []
    for step in range(3):
        _run(sched, rank, step)
        if rank == 0:
            guard.scale(torch.zeros(()))
        guard.step(opt)
        guard.update()
        opt.zero_grad()
        losses.append(guard.snapshot()["spike_loss"])
    return losses


def rebuilt_with_other_microbatches(rank: int, world: int) -> dict[str, Any]:
    """A gated run whose schedule is rebuilt at step 2 with 2 microbatches instead of 4 (shape
    inference on inf garbage again): what the gate recorded and applied."""
    guard = gate()
    modules = stage_modules("gpipe", rank, world)
    opt = torch.optim.SGD(modules[0].parameters(), lr=0.1)
    loss_fn = guard.pipeline_loss(mse)
    sched = schedule(modules, rank, world, loss_fn, 4)
    out: dict[str, Any] = {"loss": [], "applied": []}
    for step in range(4):
        if step == 2:
            _pp.GARBAGE[0] = math.inf
            sched = schedule(modules, rank, world, loss_fn, 2)
        _run(sched, rank, step)
        guard.step(opt)
        guard.update()
        opt.zero_grad()
        out["loss"].append(guard.snapshot()["spike_loss"])
        out["applied"].append(guard.step_applied())
    _pp.GARBAGE[0] = 1e8
    return {**out, "params": params_of(modules)}


def overflow_mid_accumulation(rank: int, world: int) -> dict[str, Any]:
    """Two schedule.step() calls per optimizer step; at step 1 an inf lands in the last stage's
    grads after the first of them only (rank 1): what each step did."""
    scaler = dscale.GradScaler("cpu", growth_interval=3)
    modules = stage_modules("gpipe", rank, world)
    opt = torch.optim.SGD(modules[0].parameters(), lr=0.1)
    sched = schedule(modules, rank, world, scaler.pipeline_loss(mse), _pp.MICROBATCHES)
    applied = []
    handed: list[torch.Tensor] = []  # what schedule.step(losses=...) hands back (step 0)
    for step in range(3):
        for half in range(2):
            if step == half == 0:
                x, y = batch(0)
                kwargs = {"target": y, "losses": handed}
                sched.step(x, **kwargs) if rank == 0 else sched.step(**kwargs)
                continue
            _run(sched, rank, 2 * step + half)
            if step == 1 and half == 0 and rank == 1:
                first_weight(modules).grad[0, 0] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        applied.append(scaler.step_applied())
    return {
        "applied": applied,
        "scale": float(scaler.get_scale()),
        "params": params_of(modules),
        "handed": [float(loss) for loss in handed],
    }


def pipeline_loss_on_one_rank(
    rank: int, world: int, unscale_first: bool, variant: str = "dynamic"
) -> dict[str, Any]:
    """Only the last stage's schedule gets pipeline_loss(); the first stage's scaler never saw
    it (nor a scale() call). What step() (after unscale_() if asked) does on each rank.
    ``variant``: "dynamic", "predictive_gated" (policy="predictive" with the spike gate on the
    loss and the grad norm), or "sync_free" (the device-side decision)."""
    if variant == "predictive_gated":
        scaler = dscale.GradScaler(
            "cpu", policy="predictive", spike_signals=("loss", "grad_norm"), spike_warmup=2
        )
    else:
        scaler = dscale.GradScaler("cpu", sync_free=variant == "sync_free")
        scaler._read_host_flags = variant != "sync_free"
    modules = stage_modules("gpipe", rank, world)
    opt = torch.optim.SGD(modules[0].parameters(), lr=0.1)
    loss_fn = scaler.pipeline_loss(mse) if rank == 1 else mse
    sched = schedule(modules, rank, world, loss_fn, _pp.MICROBATCHES)
    _run(sched, rank, 0)
    before = params_of(modules)
    error = ""
    try:
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
    except RuntimeError as exc:
        error = str(exc)
    after = params_of(modules)
    changed = any(not torch.equal(before[k], after[k]) for k in before)
    return {"error": error, "changed": changed}


#: The resumed run's layouts: GPipe over layers {0,1} | {2,3}, saved after step 3, resumed
#: under 1F1B over {0,1,2} | {3} (layer 2 and its Adam state move to the other rank).
SAVED_SPLIT, RESUMED_SPLIT, SAVED_AT, RESUME_STEPS, RESUME_INF = (
    [[0, 1], [2, 3]],
    [[0, 1, 2], [3]],
    3,
    6,
    4,
)


def resume_on_another_layout(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Save each stage under one split and schedule, resume under another (an inf on rank 0's
    first layer at step 4): the parameters and what each step did."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from dscale.checkpoint import CheckpointManager

    def build(split: list[list[int]], cls: Any) -> tuple[Any, Any, Any, Any]:
        module = _pp.stage_module(split[rank])
        opt = torch.optim.Adam(module.parameters(), lr=0.1)
        scaler = dscale.GradScaler("cpu", growth_interval=3)
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        sched = cls(stage, n_microbatches=_pp.MICROBATCHES, loss_fn=scaler.pipeline_loss(mse))
        return module, opt, scaler, sched

    ckpt = CheckpointManager(directory, every=SAVED_AT, keep=1)
    applied: list[bool] = []

    def train(parts: tuple[Any, Any, Any, Any], steps: range) -> None:
        module, opt, scaler, sched = parts
        for step in steps:
            _run(sched, rank, step)
            if step == RESUME_INF and rank == 0:
                first_weight([module]).grad[0, 0] = math.inf
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            applied.append(scaler.step_applied())
            ckpt.maybe_save(step + 1, model=module, optimizer=opt, scaler=scaler)

    first = build(SAVED_SPLIT, ScheduleGPipe)
    train(first, range(SAVED_AT))
    second = build(RESUMED_SPLIT, Schedule1F1B)
    start = ckpt.resume("auto", model=second[0], optimizer=second[1], scaler=second[2])
    train(second, range(start or 0, RESUME_STEPS))
    return {
        "start": start,
        "applied": applied,
        "scale": float(second[2].get_scale()),
        "params": params_of([second[0]]),
    }


def zero_bubble_v(rank: int, world: int) -> dict[str, Any]:
    """torch's ScheduleZBVZeroBubble (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; one
    layer each; the backward split in input and weight halves) with the gate; an inf in rank 1's
    stage 1 at step 2."""
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    ids = [[0, 3], [1, 2]][rank]
    modules = [_pp.stage_module([i]) for i in ids]
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1)
    guard = gate()
    stages = [
        PipelineStage(m, i, 4, torch.device("cpu")) for m, i in zip(modules, ids, strict=True)
    ]
    sched = ScheduleZBVZeroBubble(stages, n_microbatches=4, loss_fn=guard.pipeline_loss(mse))
    out: dict[str, Any] = {"loss": [], "applied": []}
    for step in range(4):
        _run(sched, rank, step)
        if step == 2 and rank == 1:
            first_weight(modules).grad[0, 0] = math.inf
        guard.step(opt)
        guard.update()
        opt.zero_grad()
        out["loss"].append(guard.snapshot()["spike_loss"])
        out["applied"].append(guard.step_applied())
    return {**out, "params": params_of(modules)}


def colliding_stage_names(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Each stage built as its own ``nn.Linear`` (the same names, "weight" and "bias", on both
    ranks, other values): saved, overwritten, loaded. What each rank got back, and any error."""
    from dscale.checkpoint import CheckpointManager

    torch.manual_seed(10 + rank)
    module = torch.nn.Linear(_pp.WIDTH, _pp.WIDTH)
    saved = params_of([module])
    ckpt = CheckpointManager(f"{directory}/colliding", every=1, keep=1)
    error = ""
    try:
        ckpt.maybe_save(1, model=module)
        with torch.no_grad():
            for p in module.parameters():
                p.zero_()
        ckpt.resume("auto", model=module)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    loaded = params_of([module])
    return {"error": error, "restored": all(torch.equal(saved[k], loaded[k]) for k in saved)}


def scenarios(rank: int, world: int, directory: str) -> dict[str, Any]:
    warnings.simplefilter("ignore")  # fp32 under a GradScaler warns that it needs no scaling
    with _pp.garbage_tensors():
        _pp.GARBAGE[0] = 1e8
        return {
            "resumed": resume_on_another_layout(rank, world, directory),
            "zbv": zero_bubble_v(rank, world),
            "colliding": colliding_stage_names(rank, world, directory),
            "dummy": kept_dummy_scale(rank, world),
            "rebuilt": rebuilt_with_other_microbatches(rank, world),
            "accumulation": overflow_mid_accumulation(rank, world),
            "one_rank_step": pipeline_loss_on_one_rank(rank, world, False),
            "one_rank_unscale": pipeline_loss_on_one_rank(rank, world, True),
            "one_rank_predictive_gated": pipeline_loss_on_one_rank(
                rank, world, False, "predictive_gated"
            ),
            "one_rank_sync_free": pipeline_loss_on_one_rank(rank, world, True, "sync_free"),
        }


# ----------------------------------------------------------------------------- PP x DP
#: 4 ranks: pipeline replica r // 2 (ranks 0-1 and 2-3), stage r % 2; the replicas' grads are
#: averaged over {0, 2} and {1, 3}. An inf goes into rank 3's grads after that average (step 2).
DP_STEPS, DP_INF = 4, (2, 3)


def dp_batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(100 * step + replica)


def pipeline_by_data_parallel(rank: int, world: int) -> dict[str, Any]:
    """GPipe x 2 replicas, dscale's StepGuard with the gate (loss and grad norm) over all 4."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    warnings.simplefilter("ignore")
    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    stage_index, replica = rank % 2, rank // 2
    guard = dscale.StepGuard(
        "cpu", spike_signals=("loss", "grad_norm"), spike_window=8, spike_warmup=2
    )
    modules = stage_modules("gpipe", stage_index, 2)
    opt = torch.optim.SGD(modules[0].parameters(), lr=0.1)
    stage = PipelineStage(modules[0], stage_index, 2, torch.device("cpu"), group=pipes[replica])
    sched = ScheduleGPipe(stage, n_microbatches=_pp.MICROBATCHES, loss_fn=guard.pipeline_loss(mse))
    out: dict[str, list[Any]] = {"applied": [], "loss": [], "grad_norm": []}
    with _pp.garbage_tensors():
        _pp.GARBAGE[0] = 1e8
        for step in range(DP_STEPS):
            x, y = dp_batch(step, replica)
            sched.step(x, target=y) if stage_index == 0 else sched.step(target=y)
            for p in modules[0].parameters():
                dist.all_reduce(p.grad, group=replicas[stage_index])
                p.grad.div_(2)
            if (step, rank) == DP_INF:
                first_weight(modules).grad[0, 0] = math.inf
            guard.step(opt)
            guard.update()
            opt.zero_grad()
            snap = guard.snapshot()
            out["applied"].append(guard.step_applied())
            out["loss"].append(snap["spike_loss"])
            out["grad_norm"].append(snap["spike_grad_norm"])
    return {**out, "params": params_of(modules)}
