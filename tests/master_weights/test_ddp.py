"""2 gloo ranks, DDP over an fp16 model: when one rank overflows, every rank skips that step."""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
from multirank import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

import dscale.scaler._program.agreement
from dscale import FP16Optimizer

from ._setup import flat, masters, mlp, train_step

STEPS = 5
POISONED_STEP = 2  # on rank 1 only, after DDP averaged the grads


def _train(rank: int, *, agree: bool) -> dict[str, Any]:
    model = DDP(mlp(seed=rank))  # DDP broadcasts rank 0's weights
    opt = FP16Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**10},
    )
    real = dscale.scaler._program.agreement.all_reduce_flag
    calls = []

    def counted(flag: torch.Tensor, group: Any) -> Any:
        calls.append(1)
        return real(flag, group) if agree else None

    skipped, scales = [], []
    with mock.patch.object(dscale.scaler._program.agreement, "all_reduce_flag", counted):
        for step in range(STEPS):
            train_step(model, opt, step, rank=rank, poison=rank == 1 and step == POISONED_STEP)
            skipped.append(opt.overflow)
            scales.append(opt.loss_scale)
    return {
        "skipped": skipped,
        "scales": scales,
        "model": flat(list(model.parameters())),
        "masters": masters(opt),
        "flag_reduces": len(calls),
    }


def _both_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    assert world_size == 2
    return {"agreed": _train(rank, agree=True), "not_agreed": _train(rank, agree=False)}


def test_every_rank_skips_when_only_rank_1_overflows_ddp_fp16_model() -> None:
    out = run_ranks(_both_scenarios, timeout_s=240)
    agreed = [out[r]["agreed"] for r in (0, 1)]

    expected_skips = [step == POISONED_STEP for step in range(STEPS)]
    assert agreed[0]["skipped"] == agreed[1]["skipped"] == expected_skips
    assert agreed[0]["scales"] == agreed[1]["scales"]
    assert agreed[0]["scales"][POISONED_STEP] == 2.0**9
    assert torch.equal(agreed[0]["model"], agreed[1]["model"])
    assert torch.equal(agreed[0]["masters"], agreed[1]["masters"])
    assert agreed[0]["flag_reduces"] == agreed[1]["flag_reduces"] == STEPS  # one per step

    # Negative control: without the scaler's all-reduce, rank 0 applies the step rank 1 skips,
    # and the two replicas drift apart.
    alone = [out[r]["not_agreed"] for r in (0, 1)]
    assert alone[0]["skipped"] == [False] * STEPS
    assert alone[1]["skipped"] == expected_skips
    assert not torch.equal(alone[0]["masters"], alone[1]["masters"])
