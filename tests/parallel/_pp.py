"""Pipeline-parallel fixtures: a 4-layer model split into stages, its schedules, and the oracle.

The oracle is the same model, the same global batch and the same microbatching in one process:
each microbatch's loss is backpropagated in order, the grads are divided by the number of
microbatches (what a schedule's ``scale_grads=True`` does), then the scaler steps.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import dscale

WIDTH, LAYERS, MICROBATCHES, BATCH = 8, 4, 4, 8
LAST = str(LAYERS - 1)
#: layers per stage: GPipe and 1F1B give each of the 2 ranks one stage of two layers;
#: interleaved 1F1B gives each rank two one-layer stages (rank r holds stages r and r + 2).
SPLITS = {"gpipe": [[0, 1], [2, 3]], "1f1b": [[0, 1], [2, 3]], "interleaved": [[0], [1], [2], [3]]}
SCHEDULES = tuple(SPLITS)


class Net(nn.Module):
    """Linear layers with ReLU between them (none after the last): a large input stays large,
    so garbage fed to the last stage gives a garbage loss, as torch's uninitialised tensors do."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(WIDTH, WIDTH) for i in range(LAYERS)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, layer in self.layers.items():
            x = layer(x)
            if name != LAST:
                x = torch.relu(x)
        return x


def full_model() -> Net:
    torch.manual_seed(0)
    return Net()


def stage_module(keep: list[int]) -> Net:
    """The full model less the layers other stages hold (names stay unique: torchtitan's way)."""
    module = full_model()
    for name in list(module.layers):
        if int(name) not in keep:
            del module.layers[name]
    return module


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


# ----------------------------------------------------------------------------- garbage
#: What torch's shape inference finds in its "uninitialised" tensors (see garbage_tensors).
GARBAGE = [1e8]


@contextlib.contextmanager
def garbage_tensors() -> Iterator[None]:
    """Fill the tensors torch 2.13's pipeline shape inference makes with ``torch.empty`` with
    ``GARBAGE[0]`` (1e8 gives a finite, huge loss; inf a NaN one): what uninitialised memory may
    hold, made deterministic. Real receive buffers are written by the receive, and zero grads
    are zeroed, so only the inference sees it."""
    from torch.distributed.pipelining import _utils

    original = _utils._make_tensor_from_meta

    def filled(meta: Any, device: Any) -> torch.Tensor:
        return original(meta, device).fill_(GARBAGE[0])

    _utils._make_tensor_from_meta = filled
    try:
        yield
    finally:
        _utils._make_tensor_from_meta = original


# ----------------------------------------------------------------------------- pipeline
def stage_modules(kind: str, rank: int, world: int) -> list[Net]:
    split = SPLITS[kind]
    return [stage_module(split[i]) for i in range(rank, len(split), world)]


def schedule_for(
    kind: str, modules: list[Net], rank: int, world: int, loss_fn: Callable[..., Any]
) -> Any:
    """A new schedule (and new PipelineStages) over ``modules``: a first step infers shapes."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    n = len(SPLITS[kind])
    ids = list(range(rank, n, world))
    stages = [
        PipelineStage(m, i, n, torch.device("cpu")) for m, i in zip(modules, ids, strict=True)
    ]
    if kind == "interleaved":
        return ScheduleInterleaved1F1B(stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=MICROBATCHES, loss_fn=loss_fn)


def params_of(modules: list[Net]) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for m in modules for n, p in m.named_parameters()}


def first_weight(modules: list[Net]) -> torch.Tensor:
    return next(iter(modules[0].layers.values())).weight


class Faults:
    """An inf written into one rank's grads at some steps, a loss spike (x1000) at others."""

    def __init__(self, inf: dict[int, int] | None = None, spikes: tuple[int, ...] = ()) -> None:
        self.inf = inf or {}
        self.spikes = spikes
        self.factor = [1.0]

    def at(self, step: int) -> None:
        self.factor[0] = 1000.0 if step in self.spikes else 1.0

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return mse(output, target) * self.factor[0]


def train_pipeline(
    kind: str,
    rank: int,
    world: int,
    scaler: Any,
    faults: Faults,
    steps: range,
    *,
    modules: list[Net] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    rebuild_at: int | None = None,
    plain_scale: bool = False,
    evaluate_at: int | None = None,
    on_step: Callable[[int, list[Net], Any], None] | None = None,
) -> dict[str, Any]:
    """Train ``steps`` under a pipeline schedule; what each step did on this rank.

    ``plain_scale``: the schedule's loss_fn returns ``scaler.scale(loss)`` and a stage without
    the loss calls ``scaler.scale(torch.zeros(()))`` (torch's scaler, and dscale before
    ``pipeline_loss()``); otherwise ``loss_fn=scaler.pipeline_loss(loss_fn)``.
    ``evaluate_at``: run ``schedule.eval()`` on a batch before that step (its losses, and what
    the gate recorded from it, are returned as "eval" and "recorded_by_eval").
    """
    modules = modules or stage_modules(kind, rank, world)
    params = [p for m in modules for p in m.parameters()]
    optimizer = optimizer or torch.optim.SGD(params, lr=0.1)
    if plain_scale:
        loss_fn: Callable[..., Any] = lambda o, t: scaler.scale(faults.loss(o, t))  # noqa: E731
    else:
        loss_fn = scaler.pipeline_loss(faults.loss)
    schedule = schedule_for(kind, modules, rank, world, loss_fn)
    out: dict[str, list[Any]] = {"applied": [], "scale": [], "loss": [], "grad_norm": []}
    for step in steps:
        if step == rebuild_at:  # as after a restart: the new schedule infers shapes again
            GARBAGE[0] = math.inf
            schedule = schedule_for(kind, modules, rank, world, loss_fn)
        if step == evaluate_at:
            out["eval"], out["recorded_by_eval"] = _evaluate(schedule, rank, scaler)
        faults.at(step)
        x, y = batch(step)
        schedule.step(x, target=y) if rank == 0 else schedule.step(target=y)
        if plain_scale and rank == 0:  # the workaround a loss-less stage needed
            scaler.scale(torch.zeros(()))
        if faults.inf.get(step) == rank:
            first_weight(modules).grad[0, 0] = math.inf
        before = [p.detach().clone() for p in params]
        scaler.step(optimizer)
        out["applied"].append(
            any(not torch.equal(b, p) for b, p in zip(before, params, strict=True))
        )
        scaler.update()
        optimizer.zero_grad()
        out["scale"].append(float(scaler.get_scale()))
        if isinstance(scaler, dscale.GradScaler) and scaler._spike is not None:
            snap = scaler.snapshot()
            out["loss"].append(snap.get("spike_loss"))
            out["grad_norm"].append(snap.get("spike_grad_norm"))
        if on_step is not None:
            on_step(step + 1, modules, optimizer)
    return {**out, "params": params_of(modules)}


def _evaluate(schedule: Any, rank: int, scaler: Any) -> tuple[list[float], int]:
    """schedule.eval() on a batch: its losses (last stage) and the microbatches the gate took."""
    x, y = batch(-1)
    losses: list[torch.Tensor] = []
    schedule.eval(x, target=y, losses=losses) if rank == 0 else schedule.eval(
        target=y, losses=losses
    )
    spike = getattr(scaler, "_spike", None)
    taken = 0 if spike is None else spike._microbatches + (spike._loss is not None)
    return [float(loss) for loss in losses], taken


# ----------------------------------------------------------------------------- the oracle
def train_oracle(
    kind: str,
    scaler: Any,
    faults: Faults,
    steps: int,
    *,
    optimizer_cls: type = torch.optim.SGD,
) -> dict[str, Any]:
    """The same training in one process: the full model, the same microbatches and faults.

    The inf goes into the first layer of the stage that held it on its rank (under GPipe and
    1F1B rank r's first layer is 2r; interleaved rank r's is r: both the first weight the rank
    holds). The loss the gate should record is the microbatches' mean: passed to scale() as
    each microbatch's share (a power-of-two division: exact), backpropagated whole.
    """
    model = full_model()
    optimizer = optimizer_cls(model.parameters(), lr=0.1)
    out: dict[str, list[Any]] = {"scale": [], "loss": [], "grad_norm": [], "applied": []}
    for step in range(steps):
        faults.at(step)
        x, y = batch(step)
        losses = []
        for xc, yc in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
            loss = faults.loss(model(xc), yc)
            losses.append(loss.detach())
            if isinstance(scaler, dscale.StepGuard):
                scaler.scale(loss / MICROBATCHES)
                loss.backward()
            else:
                scaler.scale(loss).backward()
        for p in model.parameters():
            p.grad.div_(MICROBATCHES)
        if step in faults.inf:
            model.layers[str(SPLITS[kind][faults.inf[step]][0])].weight.grad[0, 0] = math.inf
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optimizer)
        out["applied"].append(
            any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        )
        scaler.update()
        optimizer.zero_grad()
        out["scale"].append(float(scaler.get_scale()))
        out["loss"].append(float(sum(losses) / MICROBATCHES))
        if isinstance(scaler, dscale.GradScaler) and scaler._spike is not None:
            out["grad_norm"].append(scaler.snapshot().get("spike_grad_norm"))
    return {**out, "params": params_of([model])}
