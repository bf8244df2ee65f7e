"""All ranks take the same skip, grow or back-off decision in DDP, FSDP1 and FSDP2 (gloo)."""

from __future__ import annotations

from typing import Any

import torch

from tests.multirank import run_ranks
from tests.scaler._setup import (
    PARALLEL_MODES,
    batch,
    full_params,
    poison_first_grad,
    tiny_model,
    wrap,
)


def _train(parallel: str, rank: int, scaler: Any, poison_at: set[int], steps: int) -> dict:
    import dscale.scaler._program.agreement as agreement

    model = wrap(tiny_model(), parallel)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    real = agreement.all_reduce_flag

    def counting(flag: torch.Tensor, group: Any) -> Any:
        calls.append(flag.numel())
        return real(flag, group)

    agreement.all_reduce_flag = counting
    applied, scales, unchanged = [], [], []
    try:
        for step in range(steps):
            opt.zero_grad()
            loss = model(batch(rank, step)).square().mean()
            scaler.scale(loss).backward()
            if step in poison_at and rank == 1:
                poison_first_grad(model)
            before = full_params(model, parallel)
            scaler.step(opt)
            scaler.update()
            after = full_params(model, parallel)
            unchanged.append(bool(torch.equal(before, after)))
            applied.append(getattr(scaler, "step_applied", lambda: None)())
            scales.append(scaler.get_scale())
    finally:
        agreement.all_reduce_flag = real
    return {
        "applied": applied,
        "unchanged": unchanged,
        "scales": scales,
        "params": full_params(model, parallel),
        "flag_collectives": calls,
    }


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    import dscale

    out: dict[str, Any] = {}
    for parallel in PARALLEL_MODES:
        scaler = dscale.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
        out[f"{parallel}/poison"] = _train(parallel, rank, scaler, {1}, 3)
        scaler = dscale.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
        out[f"{parallel}/clean"] = _train(parallel, rank, scaler, set(), 4)
    # Negative control: torch's plain scaler under FSDP1 lets the ranks drift apart.
    out["fsdp1/torch"] = _train(
        "fsdp1", rank, torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2), {1}, 3
    )
    return out


def test_every_rank_agrees_in_ddp_fsdp1_fsdp2_when_only_rank_1_overflows() -> None:
    out = run_ranks(_scenarios)
    r0, r1 = out[0], out[1]
    for parallel in PARALLEL_MODES:
        a, b = r0[f"{parallel}/poison"], r1[f"{parallel}/poison"]
        # Step 1 is poisoned on rank 1 only: both ranks skip it, and the scale backs off once.
        assert a["applied"] == b["applied"] == [True, False, True], parallel
        assert a["unchanged"][1] and b["unchanged"][1], parallel
        assert a["scales"] == b["scales"] == [1024.0, 512.0, 512.0], parallel
        assert torch.equal(a["params"], b["params"]), parallel
        # One all-reduce per step, however many parameters: the flag with the scale fields on
        # the first iteration (and every RANGE_EVERY-th), the flag alone in between.
        assert a["flag_collectives"] == b["flag_collectives"] == [3, 1, 1], parallel

        c, d = r0[f"{parallel}/clean"], r1[f"{parallel}/clean"]
        assert c["scales"] == d["scales"] == [1024.0, 2048.0, 2048.0, 4096.0], parallel
        assert torch.equal(c["params"], d["params"]), parallel

    # Negative control, same spawn: torch's plain scaler under FSDP1 with the same poison.
    t0, t1 = r0["fsdp1/torch"], r1["fsdp1/torch"]
    # Rank 0 never saw the inf: it stepped its shard and even grew; rank 1 backed off.
    assert t0["scales"][1] == 2048.0
    assert t1["scales"][1] == 512.0
    # The poisoned step was half applied: the gathered parameters moved (rank 0's shard).
    assert not t0["unchanged"][1]
