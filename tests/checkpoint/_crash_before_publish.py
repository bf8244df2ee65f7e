"""Save step 1, then SIGKILL this process between writing step 2 and publishing it.

Run as ``python -m tests.checkpoint._crash_before_publish ROOT`` from the repository root.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from dscale.checkpoint import CheckpointManager, _publish
from tests.checkpoint._helpers import make_model, make_scaler, train


def main(root: str) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_scaler()
    ckpt = CheckpointManager(root, keep=2)
    train(model, opt, scaler, 2)
    ckpt.save(1, model=model, optimizer=opt, scaler=scaler)

    def killed_before_publish(tmp, final):
        os.kill(os.getpid(), signal.SIGKILL)

    _publish.publish = killed_before_publish
    train(model, opt, scaler, 2)
    ckpt.save(2, model=model, optimizer=opt, scaler=scaler)


if __name__ == "__main__":
    main(sys.argv[1])
