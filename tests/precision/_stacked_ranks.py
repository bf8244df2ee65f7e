"""Rank side of the stacked-fields scenario (tests/precision/test_shadow_switched.py, r43n).

One StepGuard carries a PrecisionSchedule (checked every step, a switch at step 2),
Float8Numerics and ShadowNumerics (both every step) on a DDP model; an arm with the scaler alone
is the oracle for the collectives. Rank 1 puts an outlier into the second linear's input at
step 3.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _arm(rank: int, stacked: bool) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    import dscale
    import dscale.fp8 as fp8
    from dscale.precision import PrecisionSchedule, ShadowNumerics
    from dscale.scaler._program import agreement as _agreement

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    guard = dscale.StepGuard("cpu")
    step_now = [0]
    if stacked:
        PrecisionSchedule(
            model,
            guard,
            initial={"0": "tensorwise", "2": "bf16"},
            switches={2: {"2": "tensorwise"}},
            emulate=True,
            check_every=1,
        )

    def outlier(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        if rank == 1 and step_now[0] == 3:
            out = out.clone()
            out[0, 0] = out.detach().abs().amax() * 1e6 + 1.0
        return out

    model[1].register_forward_hook(outlier)
    wrapped = DistributedDataParallel(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    numerics = fp8.Float8Numerics(wrapped, guard, every=1) if stacked else None
    shadow = ShadowNumerics(wrapped, guard, every=1) if stacked else None
    calls = [0]
    seam = _agreement.all_reduce_flag

    def counting(values: Any, group: Any) -> Any:
        calls[0] += 1
        return seam(values, group)

    _agreement.all_reduce_flag = counting
    rows = []
    try:
        dist.barrier()
        g = torch.Generator().manual_seed(10 + rank)
        for step in range(4):
            step_now[0] = step
            calls[0] = 0
            x = torch.randn(8, 32, generator=g)
            loss = wrapped(x).mean()  # grad_output the same everywhere: only inputs move
            guard.scale(loss).backward()
            guard.step(opt)
            guard.update()
            opt.zero_grad()
            rows.append(
                {
                    "agreements": calls[0],
                    "shadow": None if shadow is None else shadow.snapshot(),
                    "numerics": None if numerics is None else numerics.snapshot(),
                }
            )
    finally:
        _agreement.all_reduce_flag = seam
    return {"rows": rows, "module": type(model[2]).__name__}


def ranks(rank: int, world_size: int) -> dict[str, Any]:
    return {"bare": _arm(rank, False), "stacked": _arm(rank, True)}
