"""Measure what the agreement collective's length costs on gloo: 1 float vs 3 (docs/scaler.md).

The dynamic scaler all-reduces ``[flag, scale, -scale]`` (MAX) every step; ShardedGradScaler
all-reduces one float. On 2 gloo ranks of a 2-core machine a 1-element all-reduce is 150-250 us
faster than a 2-or-more-element one, which is most of what dscale still loses to
ShardedGradScaler in the benchmark's no-wrapper scenarios.

Run: .venv/bin/python tests/scaler/measure_flag_allreduce.py   (record `cat /proc/loadavg`)
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import start_processes

LENGTHS = (1, 2, 3, 5)
REPS = 200


def _rank(rank: int, world_size: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size
    )
    grads = [torch.randn(500_000) for _ in range(20)]  # memory traffic before, as in a step
    times: dict[int, list[float]] = {n: [] for n in LENGTHS}
    for rep in range(REPS):
        for n in LENGTHS[rep % len(LENGTHS) :] + LENGTHS[: rep % len(LENGTHS)]:
            torch._foreach_mul_(grads, 1.0)
            values = torch.zeros(n)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(values, op=dist.ReduceOp.MAX, async_op=True).wait()
            times[n].append(time.perf_counter() - start)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, times)
    if rank == 0:
        for n in LENGTHS:
            slowest = [max(t) for t in zip(*(g[n] for g in gathered))]
            print(f"{n} float(s): median {statistics.median(slowest) * 1e6:6.0f} us (slower rank)")
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        start_processes(_rank, args=(2, f"{tmp}/store"), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
