"""policy="predictive" against the dynamic rule on the runs it used to lose: spikes, zero phases.

The oracle is the dynamic rule (``policy="dynamic"``, torch's) on the same model, data and init
in the same test: the predictive policy may not skip more steps than it does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dscale


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU())
    model.append(nn.Linear(128, 16))
    with torch.no_grad():
        model[0].weight.mul_(8.0)  # wide activations
    return model


def _run(
    policy: str, weight_of, steps: int, seed: int = 0, measured: list[float] | None = None
) -> tuple[list[float], list[bool]]:
    """Train with AdamW under autocast fp16; the scale each step ran at, and which were skipped.

    ``measured`` gets the predictive scaler's last measured magnitude after each step.
    """
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**16, policy=policy)  # type: ignore[arg-type]
    scales, skipped = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 10_000 + step)
        x = torch.randn(32, 32, generator=g)
        y = torch.randint(16, (32,), generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = F.cross_entropy(out.float(), y) * weight_of(step)
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        skipped.append(not scaler.step_applied())
        if measured is not None:
            measured.append(scaler.snapshot()["grad_max_abs"])
    return scales, skipped


def test_periodic_spikes_skip_no_more_steps_than_the_dynamic_rule() -> None:
    every = 23  # a 4x loss spike every 23rd step (the grads are 4x)

    def weight(step: int) -> float:
        return 4.0 if step > 0 and step % every == 0 else 1.0

    spikes = [s for s in range(1, 120) if s % every == 0]
    for seed in (0, 1):
        _, dynamic = _run("dynamic", weight, 120, seed)
        _, predictive = _run("predictive", weight, 120, seed)
        assert sum(predictive) <= sum(dynamic), (seed, predictive, dynamic)
        # A spike that overflows is remembered (for growth_interval steps): at most one does.
        assert sum(predictive[s] for s in spikes) <= 1, (seed, predictive)


def test_a_zero_gradient_phase_holds_the_scale_and_costs_no_skip() -> None:
    phase = range(20, 60)  # the loss is multiplied by 0: every grad is 0

    def weight(step: int) -> float:
        return 0.0 if step in phase else 1.0

    for seed in (0, 1):
        _, dynamic = _run("dynamic", weight, 90, seed)
        measured: list[float] = []
        scales, predictive = _run("predictive", weight, 90, seed, measured)
        assert sum(predictive) <= sum(dynamic), (seed, predictive, dynamic)
        assert not any(predictive[phase.start :]), (seed, predictive)
        # Nothing measured holds the scale: the phase ends where it began.
        assert scales[phase.start : phase.stop + 1] == [scales[phase.start]] * (len(phase) + 1)
