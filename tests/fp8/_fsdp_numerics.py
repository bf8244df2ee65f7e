"""Float8Numerics under FSDP2 (inside the FP8 tests' one 2-rank spawn) and its one-process oracle.

Under FSDP2 the forward GEMM multiplies the gathered weight; the numerics must measure that,
so the worst rank's values equal those of the same model on one process (where the input and
grad_output of each rank are those of one-process runs on that rank's batch).
"""

from __future__ import annotations

from typing import Any

import torch

import dscale
import dscale.fp8 as fp8
from tests.fp8 import _models

RECIPES = ("tensorwise", "rowwise", "mxfp8")


def sample(recipe: str, rank: int, *, fsdp: bool, float8_all_gather: bool = False) -> Any:
    """The snapshot of step 0 (sampled) of ``recipe`` on ``rank``'s batch, sharded or not."""
    model = _models.net()
    fp8.convert_to_float8(model, recipe=recipe, emulate=True, float8_all_gather=float8_all_gather)  # type: ignore[arg-type]
    with torch.no_grad():  # an outlier in rank 0's shard: it flushes the rest of its row/block
        model.blocks[0].fc1.weight[1, 3] *= 1e7
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = dscale.StepGuard("cpu")
    numerics = fp8.Float8Numerics(model, guard, every=1)
    guard.scale(_models.loss_of(model, *_models.batch(0, rank, size=2))).backward()
    guard.step(opt)
    guard.update()
    snap = numerics.snapshot()
    numerics.close()
    return snap


def ranks(rank: int, world_size: int) -> dict[str, Any]:
    """Each recipe sharded (high-precision all-gather), and tensorwise with float8 all-gather."""
    out = {recipe: sample(recipe, rank, fsdp=True) for recipe in RECIPES}
    out["tensorwise_f8ag"] = sample("tensorwise", rank, fsdp=True, float8_all_gather=True)
    return out


def oracle(recipe: str, world_size: int = 2) -> dict[str, dict[str, float]]:
    """Field by field, the largest over one-process runs on each rank's batch (the weight is
    the same in all of them): what the worst rank must report; ``scale``, the one the largest
    amax gives (the host derives it from the agreed amax)."""
    runs = [sample(recipe, r, fsdp=False) for r in range(world_size)]
    out = {}
    for key in runs[0]:
        out[key] = {f: max(run[key][f] for run in runs) for f in runs[0][key]}
        out[key]["scale"] = max(runs, key=lambda run: run[key]["amax"])[key]["scale"]
    return out
