"""fp64 grads through every norm the scaler takes (``_unscale.norms``).

torch's ``_foreach_norm(..., dtype=torch.float32)`` refuses fp64 tensors ("should be
convertible without narrowing"), so fp64 training raised in three places: the spike gate's grad
norm (every device), predictive's measurement on a GPU, and ``NumericsStats`` (every device,
also for a list mixing fp64 with fp32). Each is checked against ``torch.linalg.vector_norm`` in
fp64; fp16/fp32 lists keep the fp32 accumulator (an fp16 norm would overflow near 65504).
"""

from __future__ import annotations

import math
from typing import Any

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


def _fp64_run(
    scaler_kind: str,
    init_scale: float,
    optimizer: str,
    device_side: bool,
    torch_scales: list[float] | None = None,
) -> dict:
    """Three steps of an fp64 model whose first and last steps have a grad element above fp32's
    largest value (finite in fp64). ``scaler_kind`` "torch" runs torch's GradScaler made afresh each
    step at ``torch_scales[step]``, the scale dscale's run used there (the predictive rule sets
    its own scale)."""
    from tests.scaler._setup import decide_on_device

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
    opt = (
        torch.optim.Adam([w], lr=0.1, fused=True)
        if optimizer == "adam_fused"
        else torch.optim.SGD([w], lr=0.1, momentum=0.9)
    )
    scaler: Any = None
    if scaler_kind != "torch":
        scaler = dscale.GradScaler("cpu", init_scale=init_scale, policy=scaler_kind)
        if device_side:
            decide_on_device(scaler)
    params, applied, scales = [], [], []
    for step in range(3):
        # fp32's largest value is about 3.4e38; the first step runs at min(init_scale, 1) here
        big = 1e39 if step != 1 else 1.0
        x = torch.tensor([big, 1.0, -2.0, 0.5, 3.0, -1.0], dtype=torch.float64)
        if scaler_kind == "torch":
            assert torch_scales is not None
            scaler = torch.amp.GradScaler("cpu", init_scale=torch_scales[step])
        scales.append(scaler.get_scale())
        opt.zero_grad()
        scaler.scale((w * x).sum()).backward()
        before = w.detach().clone()
        scaler.step(opt)
        scaler.update()
        applied.append(not torch.equal(before, w.detach()))
        params.append(w.detach().clone())
    return {"params": params, "applied": applied, "scales": scales}


@pytest.mark.parametrize("optimizer", ["adam_fused", "sgd"])
@pytest.mark.parametrize(
    ("init_scale", "device_side"),
    [(0.75, False), (1.0, True), (0.75, True), (2.0**4, False)],
    ids=["host-not-pow2", "device-pow2", "device-not-pow2", "host-pow2"],
)
@pytest.mark.parametrize("policy", ["predictive", "dynamic"])
def test_an_fp64_grad_above_fp32s_range_is_applied_as_torchs_scaler_applies_it(
    policy, init_scale, device_side, optimizer
) -> None:
    """Bit for bit with torch's GradScaler at the same scale: the element is finite in fp64, so
    the step is applied, by the predictive rule as by the dynamic one (the predictive measurement
    rounded it to an fp32 inf, which read as an overflow on the CPU's fused paths and skipped)."""
    ours = _fp64_run(policy, init_scale, optimizer, device_side)
    theirs = _fp64_run("torch", init_scale, optimizer, device_side, ours["scales"])
    assert theirs["applied"] == [True, True, True]
    assert ours["applied"] == theirs["applied"]
    for mine, torchs in zip(ours["params"], theirs["params"], strict=True):
        assert torch.equal(mine, torchs), (mine, torchs)
    if policy == "predictive":  # the value enters the float32 rule as an overflow mark: back off
        assert 0 < ours["scales"][1] <= ours["scales"][0] / 2, ours["scales"]


def _fp64_predictive_scales(init_scale: float, optimizer: str, device_side: bool) -> dict:
    """An fp64 model whose grads carry, at a scale below 1, a scaled magnitude that float32 holds
    (2.5e38 at 0.25) but whose unscaled magnitude it does not (1e39): the rule's float32 entry
    ``g / s``. torch's GradScaler runs made afresh each step at dscale's scale."""
    from tests.scaler._setup import decide_on_device

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
    opt = (
        torch.optim.Adam([w], lr=0.1, fused=True)
        if optimizer == "adam_fused"
        else torch.optim.SGD([w], lr=0.1, momentum=0.9)
    )
    ref = torch.nn.Parameter(w.detach().clone())
    ref_opt = (
        torch.optim.Adam([ref], lr=0.1, fused=True)
        if optimizer == "adam_fused"
        else torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    )
    scaler = dscale.GradScaler("cpu", init_scale=init_scale, policy="predictive")
    if device_side:
        decide_on_device(scaler)
    scales, same = [], []
    for big in (1e39, 1.0, 1e39, 1e300, 1e39, 1.0, 1.0):
        x = torch.tensor([big, 1.0, -2.0, 0.5, 3.0, -1.0], dtype=torch.float64)
        theirs = torch.amp.GradScaler("cpu", init_scale=scaler.get_scale())
        for s, p, o in ((scaler, w, opt), (theirs, ref, ref_opt)):
            o.zero_grad()
            s.scale((p * x).sum()).backward()
            s.step(o)
            s.update()
        scales.append(scaler.get_scale())
        same.append(torch.equal(w.detach(), ref.detach()))
    return {"scales": scales, "same": same, "finite": bool(torch.isfinite(w).all())}


@pytest.mark.parametrize("optimizer", ["adam_fused", "sgd"])
@pytest.mark.parametrize("device_side", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("init_scale", [0.75, 1.0])
def test_an_fp64_grad_whose_unscaled_magnitude_float32_cannot_hold_keeps_the_scale_finite(
    init_scale, device_side, optimizer
) -> None:
    """The predictive rule's entry is ``g / s`` in float32: at a scale below 1 a measured ``g``
    that float32 holds can give an inf there, and BUDGET / inf made the next scale 0 (host form;
    the device form's ring took inf * 0 = NaN and made it inf): the weights went non-finite. The
    scale must stay a positive, finite float32 and every step be torch's at the same scale."""
    got = _fp64_predictive_scales(init_scale, optimizer, device_side)
    assert all(0 < s < math.inf for s in got["scales"]), got["scales"]
    assert got["finite"], got
    assert got["same"] == [True] * len(got["same"]), got
    other = _fp64_predictive_scales(init_scale, optimizer, not device_side)
    assert other["scales"] == got["scales"]  # the host and device forms agree bit for bit
