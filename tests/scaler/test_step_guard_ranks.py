"""The step guard on 2 gloo ranks, against oracles: a run where the bad batch never happened.

One spawn runs every scenario (a spawn costs seconds): a loss spike on rank 1 only, and an inf in
rank 1's bf16 grads, each in DDP, FSDP1 and FSDP2, on every decision path (host, fused optimizer
on the device, sync_free). The guarded run must skip that step on both ranks and end with the
parameters of an unguarded run that simply left that step's batch out, bit for bit. Negative
controls show the oracle has teeth: without the gate the spiking step lands and the parameters
differ.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from tests.multirank import run_ranks
from tests.scaler._setup import batch, decide_on_device, full_params, poison_first_grad, wrap

STEPS = 20
BAD = 14  # the step whose batch is spiked / poisoned on rank 1
GATE = {"spike_window": 16, "spike_warmup": 8}


def _model(parallel: str, dtype: torch.dtype) -> torch.nn.Module:
    from tests.scaler._setup import tiny_model

    return wrap(tiny_model().to(dtype), parallel)


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)


def _train(
    rank: int,
    parallel: str,
    *,
    guard: Any = None,
    kind: str = "foreach",
    dtype: torch.dtype = torch.float32,
    spike_at: int | None = None,
    inf_at: int | None = None,
    leave_out: int | None = None,
) -> dict[str, Any]:
    import dscale.scaler._program.agreement as agreement

    model = _model(parallel, dtype)
    opt = _optimizer(model, kind)
    calls = []
    real = agreement.all_reduce_flag

    def counting(values: torch.Tensor, group: Any) -> Any:
        calls.append(values.numel())
        return real(values, group)

    agreement.all_reduce_flag = counting
    applied = []
    try:
        for step in range(STEPS):
            if step == leave_out:
                continue
            opt.zero_grad(set_to_none=True)
            loss = model(batch(rank, step).to(dtype)).float().square().mean()
            if step == spike_at and rank == 1:
                loss = loss * 1000.0  # a loss spike on one rank only
            if guard is None:
                loss.backward()
                if step == inf_at and rank == 1:
                    poison_first_grad(model)
                opt.step()
                continue
            guard.scale(loss).backward()
            if step == inf_at and rank == 1:
                poison_first_grad(model)
            guard.step(opt)
            applied.append(guard.step_applied())
            guard.update()
    finally:
        agreement.all_reduce_flag = real
    return {
        "params": full_params(model, parallel),
        "applied": applied,
        "snapshot": None if guard is None else guard.snapshot(),
        "collectives": len(calls),
    }


def _guard(cls_name: str, path: tuple[bool, bool], **kwargs: Any) -> Any:
    import dscale

    sync_free, on_device = path
    cls = getattr(dscale, cls_name)
    guard = cls("cpu", sync_free=sync_free, **kwargs)
    return decide_on_device(guard) if on_device else guard


PATHS = {"foreach": [(False, False), (True, True)], "fused": [(False, False), (False, True)]}


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for parallel in ("ddp", "fsdp1", "fsdp2"):
        kinds = ("foreach", "fused") if parallel != "fsdp1" else ("foreach",)
        for kind in kinds:
            # Loss spike on rank 1 at BAD: the gate (on the loss) skips it on both ranks.
            oracle = _train(rank, parallel, kind=kind, leave_out=BAD)
            for path in PATHS[kind]:
                for cls_name in ("StepGuard", "GradScaler"):
                    guard = _guard(cls_name, path, spike_signals=("loss",), **GATE)
                    run = _train(rank, parallel, guard=guard, kind=kind, spike_at=BAD)
                    key = f"spike/{parallel}/{kind}/{cls_name}/sync_free={path[0]}/device={path[1]}"
                    out[key] = {
                        "applied": run["applied"],
                        "equal": torch.equal(run["params"], oracle["params"]),
                        "snapshot": run["snapshot"],
                        "collectives": run["collectives"],
                    }
            # Negative control: the same spike with the gate off lands.
            plain = _train(
                rank, parallel, guard=_guard("StepGuard", (False, False)), kind=kind, spike_at=BAD
            )
            out[f"control/{parallel}/{kind}"] = torch.equal(plain["params"], oracle["params"])
        # bf16 with an inf in rank 1's grads at BAD: a StepGuard skips it on both ranks.
        oracle = _train(rank, parallel, dtype=torch.bfloat16, leave_out=BAD)
        for path in PATHS["foreach"]:
            run = _train(
                rank, parallel, guard=_guard("StepGuard", path), dtype=torch.bfloat16, inf_at=BAD
            )
            out[f"bf16/{parallel}/sync_free={path[0]}"] = {
                "applied": run["applied"],
                "equal": torch.equal(run["params"], oracle["params"]),
                "snapshot": run["snapshot"],
            }
        unguarded = _train(rank, parallel, dtype=torch.bfloat16, inf_at=BAD)
        out[f"bf16-control/{parallel}"] = bool(torch.isfinite(unguarded["params"]).all())
    out["norms"] = _norms(rank)
    return out


def _norms(rank: int) -> dict[str, Any]:
    """The gate's loss is the mean over ranks; its grad norm the global one under FSDP2."""
    import dscale

    result = {}
    for parallel in ("ddp", "fsdp2"):
        model = _model(parallel, torch.float32)
        guard = dscale.StepGuard("cpu", spike_signals=("loss", "grad_norm"), **GATE)
        loss = model(batch(rank, 0)).square().mean()
        guard.scale(loss).backward()
        grads = []
        for p in model.parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads.append(g.reshape(-1))
        full_norm = torch.cat(grads).double().norm().item()
        losses = [torch.zeros(()) for _ in range(dist.get_world_size())]
        dist.all_gather(losses, loss.detach())
        guard.step(torch.optim.SGD(model.parameters(), lr=0.0))
        guard.update()
        snap = guard.snapshot()
        result[parallel] = {
            "gate_loss": snap["spike_loss"],
            "mean_loss": sum(x.item() for x in losses) / len(losses),
            "gate_norm": snap["spike_grad_norm"],
            "full_norm": full_norm,
        }
    return result


def test_a_spike_or_an_inf_on_one_rank_skips_on_both_and_equals_leaving_the_batch_out() -> None:
    out = run_ranks(_scenarios, timeout_s=400.0)
    expected = [step != BAD for step in range(STEPS)]
    spike_keys = [k for k in out[0] if k.startswith("spike/")]
    assert len(spike_keys) == 2 * 2 * (2 + 2) + 2 * 2  # ddp/fsdp2: 2 kinds; fsdp1: foreach
    for rank in (0, 1):
        for key in spike_keys:
            got = out[rank][key]
            assert got["applied"] == expected, (rank, key)
            assert got["equal"], (rank, key)
            snap = got["snapshot"]
            assert snap["spike_skipped_steps"] == 1 and snap["skipped_steps"] == 0, (key, snap)
            assert snap["growths"] == snap["backoffs"] == 0, (key, snap)  # a spike is no overflow
            # Still one collective per step: the loss rides in the agreement all-reduce.
            assert got["collectives"] == STEPS, (key, got["collectives"])
            if "GradScaler" in key:
                assert snap["scale"] == 2.0**16, key
        for key, equal in out[rank].items():
            if key.startswith("control/"):
                assert not equal, key  # the spike lands without the gate: the oracle bites
        for parallel in ("ddp", "fsdp1", "fsdp2"):
            for sync_free in (False, True):
                got = out[rank][f"bf16/{parallel}/sync_free={sync_free}"]
                assert got["applied"] == expected, (rank, parallel, sync_free)
                assert got["equal"], (rank, parallel, sync_free)
                snap = got["snapshot"]
                assert snap["skipped_steps"] == 1 and snap["scale"] == 1.0, snap
            assert not out[rank][f"bf16-control/{parallel}"], parallel  # the inf lands unguarded
    for rank in (0, 1):
        ddp, fsdp2 = out[rank]["norms"]["ddp"], out[rank]["norms"]["fsdp2"]
        assert math.isclose(ddp["gate_loss"], ddp["mean_loss"], rel_tol=1e-6)
        assert math.isclose(fsdp2["gate_loss"], fsdp2["mean_loss"], rel_tol=1e-6)
        # FSDP2: the sum of the shards' squares is the global norm.
        assert math.isclose(fsdp2["gate_norm"], fsdp2["full_norm"], rel_tol=1e-5)
        # DDP: every rank holds the whole (averaged) grad: sqrt(world) times the norm.
        assert math.isclose(ddp["gate_norm"], math.sqrt(2) * ddp["full_norm"], rel_tol=1e-5)
    assert out[0]["norms"] == out[1]["norms"]
