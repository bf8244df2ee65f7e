"""The README's preemption recipe with ``async_save=True``, as one rank of a 2-rank gloo job.

Run as ``python -m tests.checkpoint._preempted_async RANK PORT ROOT`` from the repository root,
once per rank. Rank 1 alone gets the scheduler's SIGTERM at step 5; every rank saves step 6
asynchronously and exits 75 right away, without wait(), as the recipe did.
"""

from __future__ import annotations

import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from dscale.checkpoint import PREEMPTED_EXIT_CODE, CheckpointManager, PreemptionGuard
from tests.checkpoint._helpers import make_model, make_scaler, train


def main(rank: int, port: int, root: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_scaler()
    ckpt = CheckpointManager(root, every=2, keep=2, async_save=True)
    start = ckpt.resume("auto", model=model, optimizer=opt, scaler=scaler) or 0
    with PreemptionGuard(["SIGTERM"]) as preemption:
        for step in range(start, 50):
            train(model, opt, scaler, 1, seed=step)
            if step == 5 and rank == 1:
                signal.raise_signal(signal.SIGTERM)  # the notice, to one rank; handled here
            if preemption.should_stop():
                ckpt.save(step + 1, model=model, optimizer=opt, scaler=scaler)
                print(f"rank {rank}: exiting after saving step {step + 1}", flush=True)
                sys.exit(PREEMPTED_EXIT_CODE)
            ckpt.maybe_save(step + 1, model=model, optimizer=opt, scaler=scaler)
    sys.exit(1)  # never preempted


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
