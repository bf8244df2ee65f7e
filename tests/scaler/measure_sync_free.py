"""Measure what sync_free's masked step costs: step time, bytes copied (docs/scaler.md).

The device-side decision is forced (on the CPU a scaler reads the flag on the host and skips as a
plain step does, so sync_free costs nothing there).

Run: .venv/bin/python tests/scaler/measure_sync_free.py   (prints both; record `cat /proc/loadavg`)
"""

from __future__ import annotations

import time
import warnings

import torch

import dscale


def _run(sync_free: bool, steps: int = 30) -> tuple[float, int, int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])  # 4.2M params
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    scaler = dscale.GradScaler("cpu", sync_free=sync_free)
    # The masked step a GPU runs: on the CPU the scaler would read the flag on the host instead.
    scaler._read_host_flags = False
    x = torch.randn(32, 1024)
    times = []
    for _ in range(steps):
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        start = time.perf_counter()
        scaler.step(opt)
        scaler.update()
        times.append(time.perf_counter() - start)
    state = sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    warm = sorted(times[5:])
    return warm[len(warm) // 2], params, state


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for _ in range(2):  # the second round is the one reported (warm caches)
        plain, _, _ = _run(False)
        free, params, state = _run(True)
    print(
        f"step+update median: plain {plain * 1e3:.1f} ms, sync_free {free * 1e3:.1f} ms "
        f"({free / plain:.2f}x)"
    )
    print(
        f"copied per sync_free step: params {params / 2**20:.1f} MiB, state {state / 2**20:.1f} MiB"
    )


if __name__ == "__main__":
    main()
