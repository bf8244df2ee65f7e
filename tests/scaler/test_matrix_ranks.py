"""The differential matrix on gloo ranks: dscale with the inf on one rank only equals torch's
skipping path with the inf on every rank, bit for bit, in every topology.

torch's GradScaler does not agree across ranks, so its reference run puts the same inf on every
rank: there every rank skips the step, which is the trajectory a correct scaler must produce when
only one rank overflows. dscale gets the inf on rank 1 only (one element of its local grad where
the topology lets a write after backward through, else an inf loss), and must land on the same
parameters, optimizer state and scale, on every rank. Replicated topologies must also agree
across ranks. Scale 2**8 and world sizes 2 and 4 (powers of two) make the DDP hook bitwise.

Two spawns (2 and 4 ranks); 16 to 46 s on 2 cores shared with other jobs (by load).
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.multirank import run_ranks
from tests.scaler._setup import batch, decide_on_device, decision_paths, full_params

OPTIMIZERS = {
    "sgd-dampening-forloop": lambda p: torch.optim.SGD(
        p, lr=0.1, momentum=0.9, dampening=0.5, foreach=False
    ),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
}
# One pattern covers the cases: the first step skipped (state creation), a clean step, then two
# skips in a row mid-run, then a clean step (the single-process matrix runs each on its own).
SKIPS = {"first-and-twice-mid": (0, 2, 3)}
STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _fsdp2(model: nn.Module, ignored: set[nn.Parameter] | None = None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    return model


def _build(topology: str, groups: list[Any]) -> tuple[nn.Module, str, bool]:
    """(model, how to gather its params, whether the params are the same on every rank)."""
    base = _model()
    if topology == "plain":
        return base, "ddp", False
    if topology.startswith("ddp_subgroups"):
        mine = next(g for g in groups if dist.get_rank() in dist.get_process_group_ranks(g))
        return DDP(base, process_group=mine), "ddp", False
    if topology == "ddp_ignored":
        DDP._set_params_and_buffers_to_ignore_for_model(base, ["2.bias"])
        return DDP(base), "ddp", False
    if topology.startswith("ddp"):
        return DDP(base), "ddp", True
    if topology == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(base, device_id=torch.device("cpu")), "fsdp1", True
    if topology == "fsdp2_ignored":
        return _fsdp2(base, {base[2].bias}), "fsdp2", False
    return _fsdp2(base), "fsdp2", True


def _poison(model: nn.Module, name: str) -> None:
    p = dict(model.named_parameters())[name]
    local = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
    if local.numel():
        local.view(-1)[-1] = float("inf")


def _run(rank: int, topology: str, groups, make_opt, skips, *, scaler: Any, everywhere: bool):
    model, gather, replicated = _build(topology, groups)
    loss_poison = "attach" in topology  # attach() refuses grads written after backward
    attach = loss_poison and hasattr(scaler, "attach")  # torch's reference runs without hooks
    params = list(model.parameters())
    two = topology.endswith("two_optimizers")
    opts = [make_opt(params[:2]), make_opt(params[2:])] if two else [make_opt(params)]
    if attach:
        scaler.attach(model)
    last = "module.2.bias" if isinstance(model, DDP) else "2.bias"
    if topology == "fsdp1":
        last = next(n for n, _ in model.named_parameters())
    for step in range(STEPS):
        for opt in opts:
            opt.zero_grad()
        poisoned = step in skips and (everywhere or rank == 1)
        micro = 2 if "accumulate" in topology else 1
        for m in range(micro):
            x = batch(rank, 10 * step + m)
            loss_scale = float("inf") if (poisoned and loss_poison and m == micro - 1) else 1.0
            if "no_sync" in topology and m < micro - 1:
                with model.no_sync():
                    scaler.scale(model(x).square().mean()).backward()
            else:
                scaler.scale(model(x).square().mean() * loss_scale).backward()
        if poisoned and not loss_poison:
            _poison(model, last)
        if "clip" in topology:
            for opt in opts:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        for opt in opts:
            scaler.step(opt)
        scaler.update()
    state = [
        torch.cat([v.float().reshape(-1) for v in opt.state[p].values() if torch.is_tensor(v)])
        for opt in opts
        for p in params
        if p in opt.state
    ]
    return full_params(model, gather), state, scaler.get_scale(), replicated


def _cases(topologies: list[str], rank: int, groups: list[Any]) -> dict[str, Any]:
    import dscale

    out: dict[str, Any] = {}
    for topology, (opt_name, make_opt), (skip_name, skips) in itertools.product(
        topologies, OPTIMIZERS.items(), SKIPS.items()
    ):
        if topology == "fsdp2_ignored" and "forloop" not in opt_name:
            continue  # torch's foreach/fused kernels refuse DTensor and plain params in one list
        # torch's scaler cannot take FSDP2 DTensor grads mixed with plain ones (ignored params):
        # there the reference is dscale's own host-side skip with the inf on every rank.
        reference = dscale.GradScaler if topology == "fsdp2_ignored" else torch.amp.GradScaler
        ref_scaler = reference("cpu", init_scale=2.0**8, growth_interval=2)
        ref = _run(rank, topology, groups, make_opt, skips, scaler=ref_scaler, everywhere=True)
        for sync_free, on_device in decision_paths("fused" in opt_name):
            scaler = dscale.GradScaler(
                "cpu", init_scale=2.0**8, growth_interval=2, sync_free=sync_free
            )
            if on_device:
                decide_on_device(scaler)
            ours = _run(rank, topology, groups, make_opt, skips, scaler=scaler, everywhere=False)
            key = f"{topology}/{opt_name}/skip={skip_name}/sync_free={sync_free}/{on_device=}"
            out[key] = {
                "params_equal": torch.equal(ours[0], ref[0]),
                "state_equal": len(ours[1]) == len(ref[1])
                and all(torch.equal(a, b) for a, b in zip(ours[1], ref[1])),
                "scale": (ours[2], ref[2]),
                # A digest, not the tensor: results must stay small to cross the result pipe.
                "final": hashlib.sha256(ours[0].numpy().tobytes()).hexdigest() if ours[3] else None,
            }
    return out


TOPOLOGIES_2 = [
    "plain",
    "ddp",
    "ddp_attach",
    "ddp_attach_no_sync_accumulate",
    "ddp_attach_accumulate",
    "ddp_ignored",
    "fsdp1",
    "fsdp2",
    "fsdp2_attach",
    "fsdp2_ignored",
    "ddp_two_optimizers",
    "ddp_clip",
    "fsdp2_clip",
]
TOPOLOGIES_4 = ["ddp_subgroups", "ddp_subgroups_attach"]


def _two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    return _cases(TOPOLOGIES_2, rank, [])


def _four_ranks(rank: int, world_size: int) -> dict[str, Any]:
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    return _cases(TOPOLOGIES_4, rank, groups)


def _check(results: dict[int, dict[str, Any]]) -> None:
    failures = []
    for rank, out in results.items():
        for key, r in out.items():
            ours, ref = r["scale"]
            if not (r["params_equal"] and r["state_equal"] and ours == ref):
                failures.append(
                    f"rank {rank} {key}: {r['params_equal']=} {r['state_equal']=} "
                    f"scale {ours} vs torch {ref}"
                )
    for key, r in results[0].items():
        for rank in results:
            other = results[rank][key]
            if r["final"] is not None and r["final"] != other["final"]:
                failures.append(f"{key}: rank {rank} holds different parameters than rank 0")
    assert not failures, "\n".join(failures)


def test_matrix_on_two_ranks() -> None:
    results = run_ranks(_two_ranks, timeout_s=300)
    assert len(results[0]) >= 70  # the matrix really ran
    _check(results)


def test_matrix_with_ddp_in_subgroups_of_four_ranks() -> None:
    results = run_ranks(_four_ranks, world_size=4, timeout_s=300)
    _check(results)
