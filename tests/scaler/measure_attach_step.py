"""Measure step() + update() under attach() (DDP) at 8 and 200 parameters: its Python time.

One gloo rank, a DDP model of COUNT parameters of NUMEL floats (one DDP bucket at either count),
SGD foreach. Each repetition runs an attached backward, then times the plain optimizer step and
scaler.step() + update() on the same grads; the paired overhead is their difference (the scaler's
own work: the hooks' report, the agreement, the decision). Arms interleave in rotating order; a
second 8-parameter arm is the A/A control. Ratios with dscale.bench's bootstrap intervals; issue
34's target is 200 / 8 <= 1.1.

Run: .venv/bin/python tests/scaler/measure_attach_step.py [REPS] [NUMEL] [--bucket-view]
(e.g. 400 64; record `cat /proc/loadavg`). ``--bucket-view``: DDP's
``gradient_as_bucket_view=True``, where step() reads one version per bucket, not per grad.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dscale
from dscale.bench._stats import METHOD, noise, ratio_interval

ARMS = {"p8": 8, "p200": 200, "p8_aa": 8}
WARMUP = 5


class _Summed(nn.Module):
    def __init__(self, count: int, numel: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(count)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([(w * x).sum() for w in self.weights]).sum()


def _arm(count: int, numel: int, bucket_view: bool) -> Callable[[], tuple[float, float]]:
    model = DDP(_Summed(count, numel), gradient_as_bucket_view=bucket_view)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-9, foreach=True)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**10)
    scaler.attach(model)
    x = torch.full((numel,), 1.0 / 64)

    def run() -> tuple[float, float]:
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(model(x)).backward()
        start = time.perf_counter()
        optimizer.step()
        plain = time.perf_counter() - start
        start = time.perf_counter()
        scaler.step(optimizer)
        scaler.update()
        return plain, time.perf_counter() - start

    for _ in range(WARMUP):
        run()
    return run


def main(reps: int, numel: int, bucket_view: bool = False) -> None:
    torch.set_num_threads(1)
    runs = {name: _arm(count, numel, bucket_view) for name, count in ARMS.items()}
    names = list(ARMS)
    paired: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            plain, scaled = runs[name]()
            paired[name].append((scaled - plain) * 1e6)
    views = ", grads as bucket views" if bucket_view else ""
    print(
        f"attach() on DDP{views}, 1 gloo rank, x {numel} floats, SGD foreach, {reps} reps "
        f"({METHOD})"
    )
    for name in names:
        median = statistics.median(paired[name])
        print(f"  {name:6s} step()+update() overhead median {median:7.1f} us")
    aa = ratio_interval(paired["p8_aa"], paired["p8"])
    for label, ratio in (
        ("200 / 8 params", ratio_interval(paired["p200"], paired["p8"])),
        ("A/A 8 / 8 params", aa),
    ):
        print(
            f"  {label:18s} {ratio['estimate']:.2f} [{ratio['low']:.2f}, {ratio['high']:.2f}] "
            f"{ratio['verdict']}"
        )
    print(f"  noise: {noise(aa)}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--bucket-view"]
    reps = int(args[0]) if args else 400
    numel = int(args[1]) if len(args) > 1 else 64
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1
        )
        main(reps, numel, "--bucket-view" in sys.argv)
        dist.destroy_process_group()
