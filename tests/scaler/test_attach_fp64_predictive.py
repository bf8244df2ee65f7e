"""attach() under FSDP2 with fp64 grads and policy="predictive": the scale as without attach().

Found in review of issue 41 item 13. The hooks measured each FSDP2 unit's reduced,
unscaled shard and mapped a product ``u * s`` that float32 cannot hold to the overflow mark (65504)
before the units are combined by MAX; a finite product from another unit above 65504 (fp64 grads
reach it) then hid the mark, and the rule backed the scale off to BUDGET / (that product / s)
(2**-99 here) where dscale without attach() measures all grads at once, reads the inf as the
mark and backs off to s / 2. Both satisfy "at most s / 2", but attach() promises the plain path's
results (power-of-two scale and world size). The hooks now keep an inf as inf and the mark is
made once every unit's value is combined, as without attach(). One 2-rank spawn (gloo).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.multirank import run_ranks
from tests.scaler._setup import batch, tiny_model, wrap

MAGNITUDES = (1.0, 1e18, 1e19, 1e20, 1.0, 1e18, 1.0)


def _scales(rank: int, attach: bool) -> list[float]:
    import dscale

    model = wrap(tiny_model().double(), "fsdp2")
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**16, policy="predictive")
    if attach:
        scaler.attach(model)
    scales = []
    for step, magnitude in enumerate(MAGNITUDES):
        opt.zero_grad()
        loss = model(batch(rank, step).double() * magnitude).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _both(rank: int, world_size: int) -> dict[str, Any]:
    return {"attach": _scales(rank, True), "plain": _scales(rank, False)}


def test_fsdp2_attach_with_fp64_grads_keeps_the_predictive_scale_of_the_plain_path() -> None:
    results = run_ranks(_both, timeout_s=300)
    for rank, got in results.items():
        assert got["attach"] == got["plain"], (rank, got)
