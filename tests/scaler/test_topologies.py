"""Harder topologies on 2 gloo ranks: the DDP hook, no_sync accumulation, mixed DTensor placements,
a chosen process group, and a pickled scaler. One spawn checks them all."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.multirank import run_ranks
from tests.scaler._setup import batch, tiny_model


def _count_flag_collectives() -> tuple[list[Any], Callable[[], None]]:
    import dscale.scaler._program.agreement as agreement

    calls: list[Any] = []
    real = agreement.all_reduce_flag

    def counting(flag: torch.Tensor, group: Any) -> Any:
        calls.append(group)
        return real(flag, group)

    agreement.all_reduce_flag = counting
    return calls, lambda: setattr(agreement, "all_reduce_flag", real)


def _ddp_run(rank: int, hook: bool, poison_step: int, accumulate: bool) -> dict[str, Any]:
    import dscale

    model = DDP(tiny_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    if hook:
        scaler.attach(model)
    calls, restore = _count_flag_collectives()
    params, scales = [], []
    try:
        for step in range(5):
            opt.zero_grad()
            poison = float("inf") if (step == poison_step and rank == 1) else 1.0
            if accumulate:
                with model.no_sync():
                    scaler.scale(model(batch(rank, 100 + step)).square().mean()).backward()
            loss = model(batch(rank, step)).square().mean() * poison
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            params.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
            scales.append(scaler.get_scale())
    finally:
        restore()
    return {"params": params, "scales": scales, "collectives": len(calls)}


def _fsdp2_run(rank: int, hook: bool) -> dict[str, Any]:
    import dscale
    import dscale.scaler._check as check_module
    from tests.scaler._setup import full_params, wrap

    model = wrap(tiny_model(), "fsdp2")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    if hook:
        scaler.attach(model)
    seen: list[tuple[int, bool]] = []  # (grads, whether the pass unscales them)
    real_pass = check_module.check_and_unscale_

    def counting_pass(groups: Any, factor: Any, *args: Any) -> Any:
        grads = sum(len(g) for per_dtype in groups.values() for g in per_dtype.values())
        seen.append((grads, factor.item() != 1.0))
        return real_pass(groups, factor, *args)

    check_module.check_and_unscale_ = counting_pass
    calls, restore = _count_flag_collectives()
    params, scales = [], []
    try:
        for step in range(4):
            opt.zero_grad()
            poison = float("inf") if (step == 2 and rank == 1) else 1.0
            scaler.scale(model(batch(rank, step)).square().mean() * poison).backward()
            scaler.step(opt)
            scaler.update()
            params.append(full_params(model, "fsdp2"))
            scales.append(scaler.get_scale())
    finally:
        restore()
        check_module.check_and_unscale_ = real_pass
    return {"params": params, "scales": scales, "collectives": len(calls), "pass_sizes": seen}


def _mixed_placements(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Partial, Replicate, distribute_tensor

    import dscale

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    sharded = nn.Linear(8, 4)
    fully_shard(sharded, mesh=mesh)  # Shard(0) DTensor params
    replicated = nn.Parameter(distribute_tensor(torch.randn(4), mesh, [Replicate()]))
    plain = nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([*sharded.parameters(), replicated, plain], lr=0.1)
    scaler = dscale.GradScaler("cpu", init_scale=256.0)
    calls, restore = _count_flag_collectives()
    out: dict[str, Any] = {"applied": [], "kinds": None}
    try:
        for step, target in enumerate(["none", "sharded", "replicated", "plain"]):
            opt.zero_grad()
            h = sharded(batch(rank, step))
            # A Partial grad for `replicated`: each rank contributes its own part of the sum.
            r = replicated.to_local(grad_placements=[Partial()])
            loss = (h * r).sum() + (h * plain).sum()
            scaler.scale(loss).backward()
            if rank == 1 and target != "none":
                p = {"sharded": sharded.weight, "replicated": replicated, "plain": plain}[target]
                local = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
                local.view(-1)[0] = float("nan")
            out["kinds"] = sorted({type(p.grad).__name__ for p in opt.param_groups[0]["params"]})
            scaler.step(opt)
            scaler.update()
            out["applied"].append(scaler.step_applied(opt))
    finally:
        restore()
    out["collectives"] = len(calls)
    out["scale"] = scaler.get_scale()
    return out


def _chosen_group_and_pickle(rank: int, world_size: int) -> dict[str, Any]:
    import dscale

    group = dist.new_group(list(range(world_size)))
    scaler = dscale.GradScaler("cpu", init_scale=64.0, process_group=group)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls, restore = _count_flag_collectives()
    applied = []
    try:
        for step, clone in ((0, False), (1, True)):
            if clone:
                scaler = pickle.loads(pickle.dumps(scaler))
                scaler = copy.deepcopy(scaler)
            opt.zero_grad()
            scaler.scale(model(batch(rank, step)).sum()).backward()
            if rank == 0:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            applied.append(scaler.step_applied(opt))
    finally:
        restore()
    return {
        "applied": applied,
        "first_group_is_chosen": calls[0] is group,
        "ranks_of_second": dist.get_process_group_ranks(calls[1]),
        "scale": scaler.get_scale(),
    }


def _all(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "plain": _ddp_run(rank, hook=False, poison_step=2, accumulate=False),
        "hook": _ddp_run(rank, hook=True, poison_step=2, accumulate=False),
        "plain_acc": _ddp_run(rank, hook=False, poison_step=3, accumulate=True),
        "hook_acc": _ddp_run(rank, hook=True, poison_step=3, accumulate=True),
        "fsdp2": _fsdp2_run(rank, hook=False),
        "fsdp2_hook": _fsdp2_run(rank, hook=True),
        "mixed": _mixed_placements(rank, world_size),
        "group": _chosen_group_and_pickle(rank, world_size),
    }


def test_topologies_agree_across_ranks() -> None:
    out = run_ranks(_all)
    r0, r1 = out[0], out[1]

    # DDP hook: identical results to the plain path (power-of-two scale and world size: bitwise),
    # the same skipped step on both ranks, and the same one scaler collective per step (the
    # step checks the hooked grads again: a write through .data may be on one rank only).
    for plain, hooked in (("plain", "hook"), ("plain_acc", "hook_acc")):
        for r in (r0, r1):
            assert r[hooked]["scales"] == r[plain]["scales"], hooked
            for a, b in zip(r[hooked]["params"], r[plain]["params"]):
                assert torch.equal(a, b), hooked
        assert r0[hooked]["collectives"] == r0[plain]["collectives"] == 5
        assert r0[hooked]["scales"] == r1[hooked]["scales"]
    assert r0["hook"]["scales"] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0]
    # The poisoned step left the parameters where they were, on both ranks.
    for r in (r0, r1):
        assert torch.equal(r["hook"]["params"][1], r["hook"]["params"][2])
        assert torch.equal(r["hook_acc"]["params"][2], r["hook_acc"]["params"][3])

    # FSDP2 hook: each reduce-scatter output is unscaled and checked while hot; step() makes no
    # unscale pass over those grads, the one-element flag all-reduce stays, results match the
    # plain path.
    for r in (r0, r1):
        assert r["fsdp2_hook"]["scales"] == r["fsdp2"]["scales"] == [1024.0, 2048.0, 1024.0, 1024.0]
        for a, b in zip(r["fsdp2_hook"]["params"], r["fsdp2"]["params"]):
            assert torch.equal(a, b)  # power-of-two scale and world size: bitwise
        assert torch.equal(r["fsdp2_hook"]["params"][1], r["fsdp2_hook"]["params"][2])
        assert r["fsdp2_hook"]["collectives"] == r["fsdp2"]["collectives"] == 4
        # No unscale pass: the hooks unscaled every grad; step() checks them again, times 1 (a
        # write through .data since the reduction would be invisible to the hooks).
        assert r["fsdp2_hook"]["pass_sizes"] == [(4, False)] * 4
        assert r["fsdp2"]["pass_sizes"] == [(4, True)] * 4

    # Mixed placements (Shard DTensor, Partial/Replicate DTensor, plain tensor) in one optimizer.
    for r in (r0, r1):
        assert r["mixed"]["kinds"] == ["DTensor", "Tensor"]
        assert r["mixed"]["applied"] == [True, False, False, False]
        assert r["mixed"]["collectives"] == 4
    assert r0["mixed"]["scale"] == r1["mixed"]["scale"] == 32.0

    # A chosen process group is used, and a pickled copy finds a group over the same ranks again.
    for r in (r0, r1):
        assert r["group"]["applied"] == [False, False]
        assert r["group"]["first_group_is_chosen"]
        assert r["group"]["ranks_of_second"] == [0, 1]
        assert r["group"]["scale"] == 16.0
