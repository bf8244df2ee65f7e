"""launch/compiled_step.py's CompiledStep across a resume: bit for bit the uninterrupted run.

The oracle is the same CompiledStep loop run without a stop, in the same test (backend eager,
AdamW foreach as the launcher's demo builds it). A resumed job loads the optimizer's state, so
the warm-up (which only creates that state) must not run again: an eager AdamW step differs
from the compiled one in the last bits (docs/compiled-step.md), so an eager step after each
resume made the resumed job differ from the uninterrupted one (r46b: 2-rank launcher jobs
stopped at step 10 and resumed to 12 ended at losses 3.9584884 vs 3.9584846).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from dscale import GradScaler
from launch.compiled_step import CompiledStep
from launch.record import SkipRecord

STEPS, STOP, INF_AT = 7, 4, (2, 5)


def _parts() -> tuple[torch.nn.Module, torch.optim.Optimizer, GradScaler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    return model, opt, GradScaler("cpu", init_scale=2.0**8, growth_interval=2, sync_free=True)


def _steps(parts: Any, region: CompiledStep, steps: range) -> None:
    model, opt, scaler = parts
    for i in steps:
        x = torch.linspace(-1, 1, 24).reshape(4, 6) * (i + 1)
        scaler.scale(model(x).square().mean()).backward()
        if i in INF_AT:
            model[0].weight.grad[0, 0] = float("inf")
        region()
        opt.zero_grad(set_to_none=True)


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_resumed_compiled_step_equals_the_uninterrupted_one_bit_for_bit() -> None:
    full = _parts()
    region = CompiledStep(full[2], full[1], SkipRecord(), backend="eager")
    _steps(full, region, range(STOP))
    saved = copy.deepcopy([p.state_dict() for p in full])  # the checkpoint at STOP
    _steps(full, region, range(STOP, STEPS))

    resumed = _parts()
    for part, state in zip(resumed, saved, strict=True):
        part.load_state_dict(state)
    region = CompiledStep(resumed[2], resumed[1], SkipRecord(), backend="eager")
    _steps(resumed, region, range(STOP, STEPS))
    assert resumed[2].snapshot() == full[2].snapshot()
    assert full[2].snapshot()["skipped_steps"] == len(INF_AT)
    assert torch.equal(_params(resumed[0]), _params(full[0]))
