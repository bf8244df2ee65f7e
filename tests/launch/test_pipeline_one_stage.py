"""A pipeline of one stage (``parallel=pp parallel.pp=1`` on one rank) runs its batch.

The validation accepts ``parallel.pp=1`` on one rank; its only stage is first and last, and
``Pipeline.step`` gave it the inputs only: every worker failed at its first step with torch's
``PipeliningMetadataError: loss_fn and target required for last stage``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.multirank import run_ranks

MODEL = {"name": "gpt_small", "vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 2}


def _one_stage(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import dscale
    from launch.loop import token_loss
    from launch.models import build_model
    from launch.pipeline import Pipeline

    torch.manual_seed(0)
    model = build_model(MODEL, seq_len=8)
    tokens = torch.randint(0, 64, (4, 9))
    x, y = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():  # the oracle: the mean of the two microbatches' losses
        want = [float(token_loss(model(xc), yc)) for xc, yc in zip(x.chunk(2), y.chunk(2))]
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))
    scaler = dscale.GradScaler("cpu", init_scale=2.0**4)
    pipe = Pipeline(
        model,
        token_loss,
        mesh=mesh,
        schedule="gpipe",
        microbatches=2,
        scaler=scaler,
        device=torch.device("cpu"),
    )
    loss = float(pipe.step(x, y))
    opt = torch.optim.SGD(pipe.module.parameters(), lr=0.1)
    scaler.step(opt)
    scaler.update()
    grads = [p.grad is not None for p in pipe.module.parameters()]
    return {"loss": loss, "want": sum(want) / 2, "all_grads": all(grads)}


def test_a_pipeline_of_one_stage_takes_inputs_and_targets_and_returns_the_mean_loss() -> None:
    """parallel=pp parallel.pp=1: the one stage is first and last; its step is the batch's mean
    microbatch loss (the one-process model's), and every parameter gets a grad."""
    out = run_ranks(_one_stage, world_size=1, timeout_s=120)[0]
    assert out["loss"] == pytest.approx(out["want"], rel=1e-5)
    assert out["all_grads"]
