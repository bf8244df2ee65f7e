"""ShadowNumerics on a model whose layers a PrecisionSchedule switches mid-run (r43n).

A switch from bf16 to tensorwise or MXFP8 puts a new module in the layer's place (holding the
same parameters). Oracle: the brute-force reference (tests/precision/_brute.py) on the tensors
the layer computes with after the switch (the model's input and the layer's weight), and the
count of aten ops and all-reduces of the same run's unsampled steps without the shadow.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dscale
from dscale.precision import PrecisionSchedule, ShadowNumerics
from dscale.precision._shadow_stats import SHADOW_FORMATS
from tests.precision import _brute


def _run(shadow_every: int | None, steps: int = 4) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    guard = dscale.StepGuard("cpu")
    schedule = PrecisionSchedule(
        model, guard, initial={"0": "bf16"}, switches={2: {"0": "tensorwise"}}, emulate=True
    )
    shadow = ShadowNumerics(model, guard, every=shadow_every) if shadow_every else None
    out: dict = {"snapshots": {}, "ops": []}
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 32, generator=g)
        x[0, 0] = 1e7  # an outlier: the first layer's input flushes under tensorwise
        weight = model[0].weight.detach().clone()  # as the forward sees it
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
            loss = model(x).square().mean()
            guard.scale(loss).backward()
            guard.step(opt)
            guard.update()
            opt.zero_grad()
        out["ops"].append(sum(1 for e in p.events() if e.name.startswith("aten::")))
        if shadow is not None and shadow.sampled_last_step:
            out["snapshots"][step] = (shadow.snapshot(), x, weight)
    out["formats"] = dict(schedule.formats)
    out["module"] = type(model[0]).__name__
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    return {"plain": _run(shadow_every=None), "shadowed": _run(shadow_every=2)}


def test_the_shadow_measures_a_layer_the_schedule_switched_to_a_new_module(runs):
    """Steps 0 and 2 are sampled (every=2); the switch at step 2 (bf16 -> tensorwise: a new
    Float8Linear in the layer's place) runs from step 2's forward on. Both samples report the
    layer's input and weight as the brute force does on them; step 2 reported zeros before (the
    hooks stayed on the old module, which no longer runs)."""
    out = runs["shadowed"]
    assert out["formats"] == {"0": "tensorwise"} and out["module"] == "Float8Linear"
    assert sorted(out["snapshots"]) == [0, 2]
    for step in (0, 2):  # before and after the switch
        snap, x, weight = out["snapshots"][step]
        for op, tensor in (("input", x), ("weight", weight)):
            for fmt in SHADOW_FORMATS:
                got = snap[f"0/{op}/{fmt}"]
                want = _brute.reference(tensor, fmt, op)
                assert [got["saturated"], got["flushed"]] == pytest.approx(want, abs=0), (
                    step,
                    op,
                    fmt,
                )
        assert snap["0/input/tensorwise"]["flushed"] > 0.5  # the outlier: not a zero row


def test_unsampled_steps_add_no_op_across_a_switch(runs):
    """The shadow on a scheduled model: the unsampled steps (1 before the switch, 3 after)
    dispatch exactly the ops of the same run without the shadow."""
    plain, shadowed = runs["plain"], runs["shadowed"]
    assert shadowed["ops"][1] == plain["ops"][1] and shadowed["ops"][3] == plain["ops"][3]
    assert shadowed["ops"][2] > plain["ops"][2]


def test_schedule_numerics_and_shadow_on_one_scaler_ride_its_one_collective_on_two_ranks():
    """A PrecisionSchedule checked every step (a switch at step 2), Float8Numerics and
    ShadowNumerics sampling every step, on one StepGuard under DDP: every step runs the one
    agreement all-reduce the scaler alone runs (oracle: the same loop without them). Rank 1's
    outlier at step 3 flags only the second linear's input, on both ranks (worst rank's)."""
    from tests.fp8 import _mx_spawn

    out = {rank: r["stacked"] for rank, r in _mx_spawn.results().items()}
    for rank in (0, 1):
        bare, stacked = out[rank]["bare"]["rows"], out[rank]["stacked"]["rows"]
        assert [r["agreements"] for r in stacked] == [r["agreements"] for r in bare] == [1] * 4
        assert out[rank]["stacked"]["module"] == "Float8Linear"  # the switch happened
    assert out[0]["stacked"]["rows"][3]["shadow"] == out[1]["stacked"]["rows"][3]["shadow"]
    for step in (2, 3):
        snap = out[0]["stacked"]["rows"][step]["shadow"]
        flagged = {
            k.rsplit("/", 1)[0]
            for k, row in snap.items()
            if k.endswith("/tensorwise") and row["flushed"] > 0.1
        }
        assert flagged == ({"2/input"} if step == 3 else set()), step
    numerics = out[0]["stacked"]["rows"][3]["numerics"]
    assert set(numerics) == {"0/input", "0/weight", "0/grad_output"}
    assert max(row["flushed"] for row in numerics.values()) < 0.5  # layer 0: not flagged
