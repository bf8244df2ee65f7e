"""Tiny models on every mesh (TP, TP + sequence parallel, FSDP2 x TP, HSDP) and the runs the tests
compare: dscale's scalers and torch's beside them, each against the one-process oracle.

Every rank function here runs inside tests.multirank.run_ranks (gloo, CPU). The model is a
LayerNorm and two Linear layers; the oracle is the same model (same seed) trained in this process
alone on the same global batch, with torch's GradScaler skipping the same poisoned step.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

DIM, HIDDEN, BATCH, SEQ = 8, 16, 4, 4
STEPS, INF_STEP = 4, 2


class Tiny(nn.Module):
    """norm -> w1 -> relu -> w2: the block torchtitan's TP plan splits (colwise, then rowwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(self.norm(x))))


def global_batch(step: int) -> torch.Tensor:
    """The step's whole batch [BATCH, SEQ, DIM], the same on every rank and in the oracle."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, SEQ, DIM, generator=g)


@dataclass
class Mesh:
    """One setting: how the model is parallelized and which part of the batch this rank feeds."""

    name: str
    model: nn.Module
    oracle: nn.Module
    local_batch: Callable[[torch.Tensor], torch.Tensor]
    loss_share: float  # the local loss is sum(out^2) / this: the ranks' losses add up right
    poisoned_rank: int  # the rank that writes an inf into its grads at INF_STEP
    replicas: list[list[int]]  # groups of ranks that must hold bitwise equal params
    replica_key: str = "whole"  # what they hold alike: "whole" (Replicate params) or "local"


def _tp_plan(sequence_parallel: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence_parallel:
        return {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
    return {
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1)),
    }


_meshes: dict[tuple[Any, ...], Any] = {}


def init_device_mesh(device: str, shape: tuple[int, ...], **names: Any) -> Any:
    """torch's init_device_mesh, made once per shape and names (each call makes new groups)."""
    from torch.distributed.device_mesh import init_device_mesh as init

    key = (shape, tuple(names.get("mesh_dim_names") or ()))
    if key not in _meshes:
        _meshes[key] = init(device, shape, **names)
    return _meshes[key]


def build(name: str, rank: int, world: int) -> Mesh:
    """The model of setting ``name`` on this rank (same seed as its oracle)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = Tiny()
    oracle = copy.deepcopy(model)
    numel = BATCH * SEQ * DIM
    if name == "tp":  # TP alone: the norm stays out of the plan (a replicated plain module)
        mesh = init_device_mesh("cpu", (world,))
        model.norm.requires_grad_(False)
        oracle.norm.requires_grad_(False)
        parallelize_module(model, mesh, _tp_plan(False))
        return Mesh(name, model, oracle, lambda x: x, numel, 1, [list(range(world))])
    if name == "tp_sp":
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, _tp_plan(True))
        chunk = SEQ // world
        return Mesh(
            name,
            model,
            oracle,
            lambda x: x[:, rank * chunk : (rank + 1) * chunk],
            numel,
            1,
            [list(range(world))],
        )
    if name == "fsdp_tp":  # 2-D: FSDP2 over dp, TP + SP over tp (torchtitan's order)
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], _tp_plan(True))
        fully_shard(model, mesh=mesh["dp"])
        dp, tp = rank // (world // 2), rank % (world // 2)
        rows, chunk = BATCH // 2, SEQ // (world // 2)
        return Mesh(
            name,
            model,
            oracle,
            lambda x: x[dp * rows : (dp + 1) * rows, tp * chunk : (tp + 1) * chunk],
            numel / 2,
            1,
            [[0, 1], [2, 3]],  # a TP group holds the Replicate params' dp shard alike
        )
    if name == "fsdp":  # FSDP2 alone, 1-D: where a TP checkpoint resumes
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model, mesh=mesh)
        rows = BATCH // world
        return Mesh(
            name,
            model,
            oracle,
            lambda x: x[rank * rows : (rank + 1) * rows],
            numel / world,
            1,
            [],
        )
    if name == "hsdp":  # replicate x shard, 2 x 2
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
        rows = BATCH // world
        return Mesh(
            name,
            model,
            oracle,
            lambda x: x[rank * rows : (rank + 1) * rows],
            numel / world,
            2,  # replica 1's first rank: its inf comes after the reduction
            [[0, 2], [1, 3]],  # the same shard on both replicas
            "local",
        )
    raise ValueError(f"unknown mesh {name!r}")


def params_of(model: nn.Module, replicated_first: bool) -> list[nn.Parameter]:
    """The model's trainable params; with ``replicated_first`` the Replicate bias leads."""
    params = [p for p in model.parameters() if p.requires_grad]
    if replicated_first:
        bias = model.w2.bias  # type: ignore[union-attr]
        params = [bias, *(p for p in params if p is not bias)]
    return params


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _whole_on_tp(param: torch.Tensor) -> bool:
    """Whether every TP rank holds this param alike (Replicate on the last mesh dim, or plain)."""
    placements = getattr(param, "placements", None)
    return placements is None or placements[-1].is_replicate()


def poison(params: list[nn.Parameter]) -> None:
    """An inf in this rank's piece of a sharded grad (w1.weight's: Shard on every mesh)."""
    grads = [p.grad for p in params if p.grad is not None and p.dim() == 2]
    local(grads[0]).view(-1)[0] = math.inf


def true_norm(params: list[nn.Parameter]) -> float:
    """clip_grad_norm_ on the same (DTensor) grads, max_norm inf: the true global norm."""
    norm = torch.nn.utils.clip_grad_norm_(params, math.inf, foreach=False)
    return float(full(norm))


def run(
    setting: Mesh,
    rank: int,
    make_scaler: Callable[[nn.Module], Any] | None,
    *,
    first: bool,
    steps: range = range(STEPS),
    opt: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    write_grads: bool = True,
) -> dict[str, Any]:
    """``steps`` of SGD on ``setting``'s model with an inf at INF_STEP on its poisoned rank.

    ``write_grads`` False (attach(): a grad written after the reduction is refused) puts the inf
    into the loss's gradient instead, before the reduction, and reads no true norm (the clip
    writes the grads).
    """
    params = params_of(setting.model, first)
    opt = opt or torch.optim.SGD(params, lr=0.1)
    if scaler is None:
        assert make_scaler is not None
        scaler = make_scaler(setting.model)
    applied, scales, norms, gate = [], [], [], []
    calls, restore = _count_agreements()
    import dscale.scaler._program.placements as placements

    made = placements.ParamSet.__init__
    sets: list[int] = []

    def counted(self: Any, *args: Any) -> None:
        sets.append(1)
        made(self, *args)

    placements.ParamSet.__init__ = counted  # type: ignore[method-assign]
    try:
        _steps(setting, rank, params, opt, scaler, steps, write_grads, applied, scales, norms, gate)
    finally:
        restore()
        placements.ParamSet.__init__ = made  # type: ignore[method-assign]
    return {
        "applied": applied,
        "scales": scales,
        "local": [local(p).detach().clone() for p in params],
        "whole": [local(p).detach().clone() for p in params if _whole_on_tp(p)],
        "full": [full(p.detach()).clone() for p in params],
        "true_norms": norms,
        "gate_norms": gate,
        "agreements": len(calls),
        "param_sets": len(sets),  # placements worked out: once per param set, not per step
    }


def _count_agreements() -> tuple[list[Any], Callable[[], None]]:
    """Count dscale's one collective (the agreement all-reduce) by patching its seam."""
    import dscale.scaler._program.agreement as agreement

    calls: list[Any] = []
    real = agreement.all_reduce_flag

    def counting(flag: torch.Tensor, group: Any) -> Any:
        calls.append(group)
        return real(flag, group)

    agreement.all_reduce_flag = counting
    return calls, lambda: setattr(agreement, "all_reduce_flag", real)


def _steps(
    setting: Mesh,
    rank: int,
    params: list[nn.Parameter],
    opt: torch.optim.Optimizer,
    scaler: Any,
    steps: range,
    write_grads: bool,
    applied: list[bool],
    scales: list[float],
    norms: list[float],
    gate: list[float],
) -> None:
    for step in steps:
        opt.zero_grad()
        out = setting.model(setting.local_batch(global_batch(step)))
        loss = local(out).square().sum() / setting.loss_share
        poisoned = step == INF_STEP and rank == setting.poisoned_rank
        if poisoned and not write_grads:  # d loss / d out[0] = inf on this rank only
            loss = loss + local(out).reshape(-1)[0] * math.inf
        scaler.scale(loss).backward()
        if poisoned and write_grads:
            poison(params)
        if step != INF_STEP and write_grads:
            norms.append(true_norm(params) * (1.0 / scaler.get_scale()))
        before = [local(p).detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        applied.append(not all(torch.equal(b, local(p)) for b, p in zip(before, params)))
        scales.append(scaler.get_scale())
        if step != INF_STEP and getattr(scaler, "_spike", None) is not None:
            gate.append(scaler.snapshot()["spike_grad_norm"])


def run_oracle(setting: Mesh, first: bool) -> dict[str, Any]:
    """The same model alone in this process, whole batch, torch's scaler (skips the inf step)."""
    model = copy.deepcopy(setting.oracle)
    params = params_of(model, first)
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(global_batch(step)).square().mean()
        scaler.scale(loss).backward()
        if step == INF_STEP:
            poison(params)
        else:
            norms.append(true_norm(params) / scaler.get_scale())
        scaler.step(opt)
        scaler.update()
    return {"full": [p.detach().clone() for p in params], "norms": norms}
