"""A NaN riding the MAX agreement vector from a non-zero rank must not vanish.

gloo's MAX all-reduce (NCCL's too, MS-AMP PR #58) drops a NaN sent by a non-zero rank: every
rank gets the other ranks' value. A field registered on the scaler is appended with
``_agreement.Layout.append`` (NaN -> +inf), so through the scaler's one collective the NaN arrives
as inf on every rank. Negative controls in the same spawn: the raw collective (one element:
5.0 wins), and the same field appended with a plain ``torch.cat``, which arrives as NaN or 5.0
depending on where it sits in the vector (gloo's vectorised MAX treats NaN by operand order).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import dscale
from dscale.scaler._program import agreement as _agreement
from tests.multirank import run_ranks


class _Field:
    """Sends 5.0, or NaN on ``nan_rank``; keeps what the collective agreed."""

    def __init__(self, rank: int, nan_rank: int) -> None:
        self.value = math.nan if rank == nan_rank else 5.0
        self.slots: torch.Tensor | None = None

    def values(self, optimizer):
        return torch.tensor([self.value])

    def agreed(self, slots):
        self.slots = slots


def _through_the_scaler(rank: int, nan_rank: int) -> float:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = dscale.StepGuard("cpu")
    field = _Field(rank, nan_rank)
    guard.add_agreement_field(field)
    guard.scale(model(torch.ones(2, 4)).sum()).backward()
    guard.step(opt)
    guard.update()
    assert field.slots is not None
    return field.slots.item()


def _plain_cat(rank: int, nan_rank: int) -> float:
    """The same vector made with a plain ``torch.cat`` (no NaN -> +inf), all-reduced as is."""
    vector = torch.cat([torch.zeros(1), torch.tensor([math.nan if rank == nan_rank else 5.0])])
    _agreement.all_reduce_flag(vector, None).wait()
    return vector[1].item()


def _scenarios(rank: int, world: int) -> dict[int, dict[str, float]]:
    out = {}
    for nan_rank in range(world):
        raw = torch.tensor([math.nan if rank == nan_rank else 5.0])
        dist.all_reduce(raw, op=dist.ReduceOp.MAX)
        out[nan_rank] = {
            "raw": raw.item(),
            "plain_cat": _plain_cat(rank, nan_rank),
            "dscale": _through_the_scaler(rank, nan_rank),
        }
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_nan_from_any_rank_arrives_as_inf_where_the_raw_max_drops_it(world):
    results = run_ranks(_scenarios, world_size=world)
    for rank, per_nan_rank in results.items():
        for nan_rank, got in per_nan_rank.items():
            assert got["dscale"] == math.inf, (rank, nan_rank)  # every rank, whoever sent it
            assert got["plain_cat"] != math.inf  # unsanitised: NaN or 5.0, never an agreed inf
            if nan_rank > 0:  # the raw one-element MAX: the NaN is gone, 5.0 won
                assert got["raw"] == 5.0, (rank, nan_rank)
