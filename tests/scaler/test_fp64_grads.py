"""fp64 grads through every norm the scaler takes (``_unscale.norms``).

torch's ``_foreach_norm(..., dtype=torch.float32)`` refuses fp64 tensors ("should be
convertible without narrowing"), so fp64 training raised in three places: the spike gate's grad
norm (every device), predictive's measurement on a GPU, and ``NumericsStats`` (every device,
also for a list mixing fp64 with fp32). Each is checked against ``torch.linalg.vector_norm`` in
fp64; fp16/fp32 lists keep the fp32 accumulator (an fp16 norm would overflow near 65504).
"""

from __future__ import annotations

import math

import pytest
import torch

import dscale
from dscale.scaler._program.grad_measure import _largest_by_norm
from dscale.scaler._program.unscale import norms
from dscale.stats import NumericsStats


def _grads(*dtypes: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(7 + i, generator=gen).to(d) * 3 for i, d in enumerate(dtypes)]


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float64, torch.float64),
        (torch.float64, torch.float32),
        (torch.float32, torch.float16),
        (torch.float16, torch.float16),
    ],
    ids=["fp64", "fp64+fp32", "fp32+fp16", "fp16"],
)
@pytest.mark.parametrize("ord", [2, math.inf])
def test_norms_equal_the_fp64_norm_of_each_tensor(dtypes, ord) -> None:
    grads = _grads(*dtypes)
    got = norms(grads, ord)
    for grad, norm in zip(grads, got, strict=True):
        want = torch.linalg.vector_norm(grad.double(), ord)
        assert norm.dtype == (torch.float64 if grad.dtype == torch.float64 else torch.float32)
        assert norm.double().item() == pytest.approx(want.item(), rel=1e-6)


def test_an_fp16_norm_near_its_max_does_not_overflow() -> None:
    big = torch.full((4,), 60000.0, dtype=torch.float16)
    assert norms([big], 2)[0].item() == pytest.approx(120000.0, rel=1e-3)


def test_predictives_gpu_form_measures_fp64_grads() -> None:
    grads = _grads(torch.float64, torch.float64)
    want = max(g.abs().max().item() for g in grads)
    got = _largest_by_norm(grads)
    assert got.dtype == torch.float32
    assert got.item() == torch.tensor(want, dtype=torch.float32).item()


def test_fp64_training_with_the_spike_gate_and_numerics_stats_runs_as_fp32_would() -> None:
    def run(dtype: torch.dtype) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2).to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = dscale.StepGuard("cpu", spike_signals=("loss", "grad_norm"), spike_warmup=2)
        stats = NumericsStats(list(model.named_parameters()))
        guard.add_observer(stats)
        seen = []
        for step in range(4):
            opt.zero_grad()
            guard.scale(model(torch.full((3, 4), 1.0 + step, dtype=dtype)).sum()).backward()
            guard.step(opt)
            guard.update()
            seen.append(guard.snapshot()["spike_grad_norm"])
        seen.append(stats.read().grad_norm)
        return seen

    fp64, fp32 = run(torch.float64), run(torch.float32)
    assert fp64 == pytest.approx(fp32, rel=1e-5)
