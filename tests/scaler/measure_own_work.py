"""Measure dscale's own per-step work against ShardedGradScaler's, with the collective held equal.

One gloo rank, so both scalers make the same one-float all-reduce at the cost of a local one and
what is left is each scaler's Python and kernels. Precomputed grads, SGD, step + update minus the
plain step of the same repetition, arms interleaved in rotating order; a second
ShardedGradScaler is the A/A arm, and dscale.bench's floor arm (torch's kernel, the all-reduce,
the decision, nothing else) bounds what any scaler could win; ratios with dscale.bench's
bootstrap intervals. docs/benchmarks.md quotes these figures.

Run: .venv/bin/python tests/scaler/measure_own_work.py COUNT NUMEL foreach|fused [REPS]
(e.g. 2000 1000 foreach; record `cat /proc/loadavg`)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import dscale
from dscale.bench._arms import FloorScaler
from dscale.bench._stats import METHOD, noise, ratio_interval

ARMS = ("plain", "dscale", "sharded", "sharded_aa", "floor")


def main(count: int, numel: int, impl: str, reps: int) -> None:
    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(count)]
    grads = [torch.randn(numel) for _ in range(count)]
    optimizer = torch.optim.SGD(params, lr=1e-6, **{impl: True})  # type: ignore[arg-type]
    scalers = {
        "dscale": dscale.GradScaler(
            "cpu", init_scale=1.0, process_group=dist.group.WORLD
        ),  # given, so it all-reduces over one rank as ShardedGradScaler does
        "sharded": ShardedGradScaler("cpu", init_scale=1.0),
        "sharded_aa": ShardedGradScaler("cpu", init_scale=1.0),
        "floor": FloorScaler(torch.device("cpu"), init_scale=1.0, agree=True),
    }
    for scaler in scalers.values():
        scaler.scale(torch.ones(1))

    def run(arm: str) -> float:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.mul(1.0)  # fresh grads each step, as after a backward
        start = time.perf_counter()
        if arm == "plain":
            optimizer.step()
        else:
            scaler = scalers[arm]
            if impl == "fused" and arm.startswith("sharded"):
                scaler.unscale_(optimizer)  # the fused path makes no all-reduce otherwise
            scaler.step(optimizer)
            scaler.update()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for rep in range(reps):
        for arm in ARMS[rep % len(ARMS) :] + ARMS[: rep % len(ARMS)]:
            times[arm].append(run(arm))
    # Paired overheads (the plain step of the same repetition subtracted), as dscale.bench does.
    paired = {
        arm: [(t - p) * 1e6 for t, p in zip(times[arm], times["plain"], strict=True)]
        for arm in ARMS[1:]
    }
    print(f"{count} x {numel}, SGD {impl}, {reps} repetitions ({METHOD})")
    for arm in ARMS[1:]:
        print(f"  {arm:10s} overhead median {statistics.median(paired[arm]):8.1f} us")
    aa = ratio_interval(paired["sharded_aa"], paired["sharded"])
    for name, ratio in (
        ("dscale / sharded", ratio_interval(paired["dscale"], paired["sharded"])),
        ("dscale / floor", ratio_interval(paired["dscale"], paired["floor"])),
        ("floor / sharded", ratio_interval(paired["floor"], paired["sharded"])),
        ("A/A sharded_aa / sharded", aa),
    ):
        print(
            f"  {name:25s} {ratio['estimate']:.2f} [{ratio['low']:.2f}, {ratio['high']:.2f}] "
            f"{ratio['verdict']}"
        )
    print(f"  noise: {noise(aa)}")


if __name__ == "__main__":
    count, numel, impl = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    reps = int(sys.argv[4]) if len(sys.argv) > 4 else 80
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1
        )
        main(count, numel, impl, reps)
        dist.destroy_process_group()
