"""A plain torchrun script, as users have them, that also asks for the launcher's context.

Part 1 uses only what torchrun gives (env, argv, init_process_group). Part 2 calls
launch.get_context() and trains a few steps with its scaler and fault injection. Each rank writes
what it saw to RUN_DIR/script-rank<R>.json.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

ENV = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, required=True)
    args = parser.parse_args()
    seen = {"env": {k: os.environ.get(k) for k in ENV}, "argv": sys.argv[1:]}
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    seen["all_reduce"] = total.item()

    from launch import get_context

    ctx = get_context()  # reuses the group made above
    seen["ctx"] = {"rank": ctx.rank, "world_size": ctx.world_size, "same": ctx is get_context()}
    model = ctx.parallelize(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.epochs):
        with ctx.autocast():
            loss = model(torch.ones(2, 4)).float().sum()
        ctx.scaler.scale(loss).backward()
        ctx.faults.after_backward(step, model)
        ctx.scaler.step(optimizer)
        ctx.scaler.update()
        optimizer.zero_grad()
    seen["skipped_steps"] = ctx.record.skipped_steps
    (ctx.run_dir / f"script-rank{ctx.rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
