"""On CUDA the scaler adds no host sync: fused and sync-free steps, and plain updates.

Skipped without CUDA (this project's CI has none); run them where a GPU is lent.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dscale

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (sync debug mode)"),
    pytest.mark.filterwarnings("ignore:dscale.GradScaler.*:UserWarning"),
]


def _iteration(model, opt, scaler, poison: bool, strict: bool = True) -> None:
    opt.zero_grad(set_to_none=False)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(torch.randn(8, 64, device="cuda")).float().square().mean()
    scaler.scale(loss).backward()
    if poison:
        model.weight.grad.view(-1)[0] = float("inf")
    # Only the scaler's own calls run in "error" mode: any host sync in them raises. Not
    # strict: the step that creates the optimizer state reads the flag once (_masked_step).
    torch.cuda.set_sync_debug_mode("error" if strict else "default")
    try:
        scaler.step(opt)
        scaler.update()
        scaler.counters()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _frozen() -> nn.Parameter:
    return nn.Parameter(torch.zeros(3, device="cuda"), requires_grad=False)


@pytest.mark.parametrize(
    ("name", "make_opt", "sync_free"),
    [
        ("adam-fused", lambda p: torch.optim.Adam(p, lr=1e-3, fused=True), False),
        ("adamw-fused", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True), False),
        ("adam-capturable", lambda p: torch.optim.Adam(p, lr=1e-3, capturable=True), True),
        ("sgd-foreach", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), True),
        # No momentum: no state, so no step creates any and none may read the flag.
        ("sgd-fused-stateless", lambda p: torch.optim.SGD(p, lr=0.1, fused=True), False),
        ("sgd-foreach-stateless", lambda p: torch.optim.SGD(p, lr=0.1), True),
        # A frozen parameter among the rest never gets state either (fine-tuning).
        ("adam-fused-frozen", lambda p: torch.optim.Adam([*p, _frozen()], fused=True), False),
    ],
)
def test_fused_and_sync_free_steps_never_sync(name, make_opt, sync_free) -> None:
    model = nn.Linear(64, 64).cuda()
    opt = make_opt(model.parameters())
    scaler = dscale.GradScaler("cuda", init_scale=2.0**10, sync_free=sync_free)
    before = None
    # The first step creates the optimizer state and reads the flag once (see _masked_step).
    scaler.scale(model(torch.randn(8, 64, device="cuda")).float().sum()).backward()
    scaler.step(opt)
    scaler.update()
    for step in range(4):
        if step == 2:
            before = model.weight.detach().clone()
        _iteration(model, opt, scaler, poison=step == 2)
        if step == 2:
            assert torch.equal(model.weight, before), name  # the poisoned step was skipped
    assert scaler.get_scale() == 2.0**9
    assert scaler.step_applied(opt)


def test_plain_step_syncs_once_for_the_skip_decision_and_update_never() -> None:
    model = nn.Linear(64, 64).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dscale.GradScaler("cuda", init_scale=2.0**10)
    scaler.scale(model(torch.randn(8, 64, device="cuda")).sum()).backward()
    scaler.step(opt)  # reads the agreed flag, as torch's scaler does
    torch.cuda.set_sync_debug_mode("error")
    try:
        scaler.update()
        assert scaler.get_scale() == 2.0**10  # the host holds it: no device read
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("sync_free", [False, True])
def test_predictive_policy_measures_and_updates_without_a_sync(sync_free) -> None:
    model = nn.Linear(64, 64).cuda()
    if sync_free:
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = dscale.GradScaler("cuda", policy="predictive", sync_free=sync_free)
    scales = []
    for step in range(4):
        before = model.weight.detach().clone()
        _iteration(model, opt, scaler, poison=step == 2, strict=step > 0)
        if step == 2:
            assert torch.equal(model.weight, before)  # the poisoned step was skipped
        scales.append(scaler.get_scale())
    assert scales[0] > 1.0  # the first measurement set the scale (the first step ran at 1)
    assert scales[2] == scales[1] / 2  # the overflow backed off
    assert scales[3] == scales[2]  # and is remembered (growth_interval steps)
