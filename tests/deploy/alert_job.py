"""A dscale job whose faults the alert test switches on and off: ``entrypoint=...alert_job:main``.

Rank 0 reads the phase from the file ``args.control`` before every step and broadcasts it, so
every rank acts on the same phase at the same step:

- ``clean``: plain fp16 steps;
- ``overflow``: rank 1 puts an inf into its gradients every step, so every rank skips, the scale
  halves down to ``scaler.min_scale`` and the skips pile up (DScaleStepsSkippedInARow,
  DScaleLossScaleCollapsed, DScaleHighSkipRate);
- ``spike``: rank 1 multiplies its loss by 3 every step; the spike gate (launched with
  ``scaler.spike_signals=[loss]``) skips every step on every rank (DScaleSpikeSkipsInARow);
- ``disagree``: rank 1 doubles its own scale once, so the ranks hold different scales
  (DScaleRanksDisagree) until a restart;
- ``flush``: rank 1's loss weighs its layer's output so that the output's gradient is one
  element 2000 among 127 of 2e-7 (non-zero in fp16), and the FP8 cast flushes the 127 to zero:
  the all-zero-gradients failure (DScaleFP8GradientsFlushed, from the FP8 rules); the layer is
  torchao's float8 linear (tensorwise, emulated) and ``Float8Numerics`` samples it every step,
  served by the exporter;
- ``kill``: rank 1 SIGKILLs itself in the first attempt; its published target stays behind
  until the restarted rank serves the port again (DScaleExporterDown);
- ``done``: return.

Steps are paced by ``args.pace_s`` so that a 1 s scrape interval sees every phase.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from launch.context import RunContext
from launch.faults import poison_grads


def _phase(ctx: RunContext, control: Path) -> str:
    phase = [control.read_text().strip() if ctx.rank == 0 else ""]
    dist.broadcast_object_list(phase, src=0)
    return str(phase[0])


def main(ctx: RunContext) -> dict[str, Any]:
    control, pace_s = Path(ctx.args.control), float(ctx.args.pace_s)
    import dscale.fp8 as fp8

    model = nn.Sequential(nn.Linear(16, 16))
    fp8.convert_to_float8(model, emulate=True)
    model = ctx.parallelize(model)
    numerics = fp8.Float8Numerics(model, ctx.scaler, every=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16)
    steps, disagreed = 0, False
    with ctx.metrics(model):
        while (phase := _phase(ctx, control)) != "done":
            if phase == "kill" and ctx.rank == 1 and ctx.attempt == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            with ctx.autocast():
                out = model(x)
                loss = out.float().pow(2).mean()
            if phase == "flush" and ctx.rank == 1:
                loss = (out.float() * _flushing(out, ctx.scaler.get_scale())).sum()
            if phase == "spike" and ctx.rank == 1:
                loss = loss * 3.0  # far above the window, and no fp16 overflow at the scale
            ctx.scaler.scale(loss).backward()
            if phase == "overflow" and ctx.rank == 1:
                poison_grads(model)
            ctx.scaler.step(optimizer)
            if phase == "disagree" and ctx.rank == 1 and not disagreed:
                ctx.scaler.update(new_scale=ctx.scaler.get_scale() * 2)
                disagreed = True
            else:
                ctx.scaler.update()
            optimizer.zero_grad()
            steps += 1
            time.sleep(pace_s)  # pacing for the scraper, not synchronisation
    numerics.close()
    return {"steps": steps}


def _flushing(out: torch.Tensor, scale: float) -> torch.Tensor:
    """Loss weights giving ``out`` the scaled gradient 2000 at one element and 2e-7 elsewhere:
    under the tensorwise E5M2 scale (57344 / 2000) the small ones fall below half of E5M2's
    smallest subnormal and cast to zero (127 of 128 flushed), while the weight's gradient stays
    finite in fp16 (no skipped step)."""
    weights = torch.full(out.shape, 2e-7 / scale)
    weights.view(-1)[0] = 2000.0 / scale
    return weights
