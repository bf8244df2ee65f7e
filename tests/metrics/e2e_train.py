"""A tiny 2-rank fp32 job for the end-to-end Prometheus test; run it under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/metrics/e2e_train.py \
        --port 19400 --out DIR --linger-s 300

Rank 1 poisons a grad at step 4, so both ranks skip it and the scale saw-tooths. After training each
rank writes its final counters to DIR/final-rank<R>.json (the values Prometheus must show), then
serves /metrics for --linger-s seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

import dscale
from dscale.metrics import MetricsLog, start_exporter
from dscale.stats import track_numerics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--linger-s", type=float, default=300.0)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(name)s: %(message)s")
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = dscale.GradScaler(device="cpu", init_scale=2.0**10, growth_interval=3)
        stats = track_numerics(scaler, model, every=5)
        log = MetricsLog(args.out, stats=stats, rank=rank, every=4)
        scaler.add_observer(log)
        exporter = start_exporter(
            scaler, stats, port=args.port, job_name="e2e", linger_s=args.linger_s,
            check_agreement_every=2,
        )  # fmt: skip
        for step in range(args.steps):
            opt.zero_grad()
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
            scaler.scale(model(x).sum()).backward()
            if rank == 1 and step == 4:
                model.module.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        log.close()
        final = scaler.snapshot()
        tmp = os.path.join(args.out, f".final-rank{rank}.json")
        with open(tmp, "w") as f:
            json.dump(final, f)
        os.replace(tmp, os.path.join(args.out, f"final-rank{rank}.json"))  # published whole
        logging.getLogger("e2e").info("final %s", final)
        exporter.stop()  # lingers so the last values get scraped
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
