"""A single-process run that gets SIGTERM at step 5, then a second signal or SIGKILL mid-save.

Run as ``python -m tests.checkpoint._preempted_save MODE ROOT`` from the repository root, with
MODE ``second-signal`` (another SIGTERM while the preemption checkpoint is being written) or
``kill`` (SIGKILL there, as a scheduler does when the grace period ends).
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from dscale.checkpoint import PREEMPTED_EXIT_CODE, CheckpointManager, PreemptionGuard
from dscale.checkpoint._hashing import HashingWriter
from tests.checkpoint._helpers import make_model, make_scaler, train


def main(mode: str, root: str) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_scaler()
    ckpt = CheckpointManager(root, every=1000, keep=2)
    train(model, opt, scaler, 2)
    ckpt.save(2, model=model, optimizer=opt, scaler=scaler)  # the previous checkpoint
    real_write = HashingWriter.write_data

    def interrupted_write(self, plan, planner):
        os.kill(os.getpid(), signal.SIGTERM if mode == "second-signal" else signal.SIGKILL)
        return real_write(self, plan, planner)

    with PreemptionGuard(["SIGTERM"]) as guard:
        for step in range(2, 50):
            train(model, opt, scaler, 1, seed=step)
            if step == 5:
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
            if guard.should_stop():
                HashingWriter.write_data = interrupted_write
                ckpt.save(step + 1, model=model, optimizer=opt, scaler=scaler)
                print(f"saved step {step + 1} after {guard.num_received} signals", flush=True)
                sys.exit(PREEMPTED_EXIT_CODE)
    sys.exit(1)  # never preempted


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
