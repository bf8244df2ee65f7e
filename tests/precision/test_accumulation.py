"""Gradient accumulation: a sampled step's numerics are its worst micro-batch's (r43n).

Float8Numerics and ShadowNumerics measured each micro-batch and kept the last one only, so an
outlier in an earlier micro-batch went unseen (the class of marin #7659: accumulation kept the
last micro-batch's amax). Oracle: the brute-force-tested stats functions on each micro-batch's
input, the largest of them field by field (every field is worse when larger, as across ranks).
"""

from __future__ import annotations

import torch
from torch import nn

import dscale
import dscale.fp8 as fp8
from dscale.precision import ShadowNumerics
from dscale.precision._shadow_stats import SHADOW_FORMATS, all_stats


def test_a_sampled_step_reports_its_worst_micro_batch_in_numerics_and_shadow():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    fp8.convert_to_float8(model, emulate=True)
    guard = dscale.StepGuard("cpu")
    numerics = fp8.Float8Numerics(model, guard, every=1)
    shadow = ShadowNumerics(model, guard, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    micro = [torch.randn(32, 32, generator=g) for _ in range(2)]
    micro[0][3, 5] = 1e7  # an outlier in the first micro-batch only
    for x in micro:
        guard.scale(model(x).mean() / len(micro)).backward()
    guard.step(opt)
    guard.update()
    want = torch.maximum(*(fp8.tensor_stats(x, torch.float8_e4m3fn) for x in micro))
    got = numerics.snapshot()["0/input"]
    assert [got[f] for f in ("amax", "saturated", "flushed", "subnormal")] == want.tolist()
    assert got["flushed"] > 0.5  # the outlier's micro-batch, not the last one's
    shadow_want = torch.maximum(*(all_stats(x, "input") for x in micro)).tolist()
    snap = shadow.snapshot()
    got_shadow = [snap[f"0/input/{f}"][k] for f in SHADOW_FORMATS for k in ("saturated", "flushed")]
    assert got_shadow == shadow_want
