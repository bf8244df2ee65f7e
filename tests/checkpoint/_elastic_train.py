"""A tiny DDP training run for the SIGKILL resume test (run under torchrun).

Rank 1 SIGKILLs itself once, after ``--kill-at`` steps (a marker file makes it once only);
torchrun restarts both ranks, which resume from the newest checkpoint. Rank 0 writes the final
step, scale and parameters to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dscale.checkpoint import CheckpointManager
from tests.checkpoint._helpers import make_model, make_scaler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--kill-at", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    torch.use_deterministic_algorithms(True)
    model = torch.nn.parallel.DistributedDataParallel(make_model(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = make_scaler(init_scale=1024.0, growth_interval=2)
    torch.manual_seed(1000 + rank)  # dropout masks differ per rank and must resume per rank
    ckpt = CheckpointManager(args.dir, every=2, keep=2)
    start = ckpt.resume("auto", model=model, optimizer=opt, scaler=scaler) or 0
    marker = Path(args.dir) / "killed-once"

    for step in range(start, args.steps):
        gen = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(8, 4, generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        if step == 4 and rank == 1:
            loss = loss * float("inf")  # one rank overflows: every rank must skip
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if step + 1 == args.kill_at and rank == 1 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.maybe_save(step + 1, model=model, optimizer=opt, scaler=scaler)
    ckpt.save(args.steps, model=model, optimizer=opt, scaler=scaler)
    ckpt.wait()

    if rank == 0:
        state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        torch.save(state, args.out + ".pt")
        summary = {
            "resumed_from": start,
            "steps": args.steps,
            "scale": scaler.get_scale(),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        }
        Path(args.out).write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
