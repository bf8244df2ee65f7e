"""On CUDA, the observers add no host sync on the steps they do not report."""

from __future__ import annotations

import pytest
import torch

from dscale.metrics import MetricsLog
from dscale.stats import NumericsStats

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (sync debug mode)"),
]


class _CountersOnly:
    """The counters() a GradScaler exposes, as live CUDA tensors."""

    def __init__(self) -> None:
        self.c = {
            "scale": torch.full((), 1024.0, device="cuda"),
        }
        for key in ("steps", "growths", "backoffs", "growth_tracker"):
            self.c[key] = torch.zeros((), dtype=torch.int64, device="cuda")

    def counters(self) -> dict[str, torch.Tensor]:
        return self.c


def test_stats_and_log_never_sync_between_reports(tmp_path) -> None:
    # fp16 parameters with fp16 grads, as a model stored in fp16 has (torch refuses a grad whose
    # dtype differs from its parameter's).
    params = [
        (f"p{i}", torch.nn.Parameter(torch.zeros(64, device="cuda", dtype=torch.float16)))
        for i in range(3)
    ]
    stats = NumericsStats(params, underflow_every=2)
    scaler = _CountersOnly()
    log = MetricsLog(tmp_path, stats=stats, every=100)
    scale = scaler.c["scale"]
    flags = [torch.full((), float(i == 3), device="cuda") for i in range(6)]
    for _, p in params:
        p.grad = torch.randn(64, device="cuda", dtype=torch.float16)
    grads = [p.grad for _, p in params]
    stats.on_grads(None, grads, scale)  # first call allocates and uploads the index once
    stats.on_update(scaler, flags[0])
    log.on_update(scaler, flags[0])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 6):
            for _, p in params:
                p.grad = torch.randn(64, device="cuda", dtype=torch.float16)  # new tensors
            grads = [p.grad for _, p in params]
            stats.on_grads(None, grads, scale)
            stats.on_update(scaler, flags[step])
            scaler.c["steps"] += 1
            log.on_update(scaler, flags[step])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    snap = stats.read()
    assert snap.steps_observed == 6
    assert snap.last_step_skipped is False
