"""Preemption exits with an asynchronous save in flight: the save must be published.

``python -m tests.checkpoint._preempted_async guard RANK PORT ROOT``: docs/checkpoints.md's
recipe on one rank of a 2-rank gloo job, without ``wait()``. Rank 1 alone gets the scheduler's
SIGTERM at step 5; every rank saves step 6 asynchronously and calls ``sys.exit(75)`` inside the
PreemptionGuard. The process then ends with ``os._exit``: C++ teardown of gloo ranks sometimes
aborts after the last Python frame (see tests/multirank.py), and this skips atexit hooks too, so
what is published was published by the guard.

``python -m tests.checkpoint._preempted_async exit ROOT``: one process, no guard, ``sys.exit(75)``
right after an asynchronous save; what is published was published at interpreter exit.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from dscale.checkpoint import PREEMPTED_EXIT_CODE, CheckpointManager, PreemptionGuard
from tests.checkpoint._helpers import make_model, make_scaler, train


def recipe(rank: int, port: int, root: str) -> None:
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


def exit_in_flight(root: str) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_scaler()
    train(model, opt, scaler, 3)
    CheckpointManager(root, async_save=True).save(3, model=model, optimizer=opt, scaler=scaler)
    sys.exit(PREEMPTED_EXIT_CODE)


if __name__ == "__main__":
    if sys.argv[1] == "exit":
        exit_in_flight(sys.argv[2])
    try:
        recipe(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    except SystemExit as exc:
        sys.stdout.flush()
        os._exit(int(exc.code or 0))
