"""Per-rank entry point that the elastic agent starts: set up, train, report to the parent.

This is the only launcher module that calls ``init_process_group``. It receives the resolved config
as a plain dict (no Hydra in workers) and the run folder the parent chose, so ranks never create
output folders of their own.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from launch import integrations
from launch.data import build_batches
from launch.faults import Faults
from launch.loop import TrainState, train
from launch.models import build_model
from launch.preemption import PREEMPTED_EXIT_CODE, Preempted
from launch.progress import Progress, RankZeroProgress

logger = logging.getLogger(__name__)


class _ConsoleFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return bool(getattr(record, "console", True))


def setup_logging(run_dir: Path, rank: int, attempt: int) -> None:
    """Every rank logs to ``logs/rank<r>.log``; rank 0 also to the console."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(
        f"%(asctime)s [rank{rank} attempt{attempt}] %(levelname)s %(name)s: %(message)s"
    )
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    file_handler = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
    file_handler.setFormatter(fmt)
    root.addHandler(file_handler)
    if rank == 0:
        console = logging.StreamHandler()
        # On a terminal, clear the progress bar's line first; the next update redraws it.
        clear = "\r\033[K" if sys.stderr.isatty() else ""
        console.setFormatter(logging.Formatter(f"{clear}[rank0] %(message)s"))
        console.addFilter(_ConsoleFilter())
        root.addHandler(console)


def pick_device(name: str, local_rank: int) -> torch.device:
    """``auto``: this rank's GPU when CUDA is there, else the CPU."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def wrap_model(model: nn.Module, strategy: str, device: torch.device) -> nn.Module:
    """DDP, FSDP2 ``fully_shard`` (each block, then the root), or nothing."""
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # Our loop never modifies the logits in place, which is what this warning is about.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks():  # type: ignore[operator]
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return model


def _run(
    cfg: dict[str, Any], run_dir: Path, rank: int, device: torch.device, attempt: int
) -> dict[str, Any]:
    trainer, data = cfg["trainer"], cfg["data"]
    world, local_rank = dist.get_world_size(), int(os.environ["LOCAL_RANK"])
    torch.manual_seed(trainer["seed"])  # the same initial weights on every rank
    model = build_model(cfg["model"], seq_len=data["seq_len"]).to(device)
    model = wrap_model(model, cfg["parallel"]["strategy"], device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=trainer["lr"])
    scaler = integrations.build_scaler(cfg["scaler"], trainer["precision"], device)
    state = TrainState()
    checkpoints = integrations.Checkpoints(cfg["checkpoint"], model, optimizer, scaler, state)
    resumed_from = checkpoints.resume()
    state.step = resumed_from or 0
    tokens_per_step = world * data["batch_size"] * data["seq_len"]
    progress_type = RankZeroProgress if rank == 0 else Progress
    progress = progress_type(trainer["max_steps"], trainer["log_every"], tokens_per_step)
    batches = build_batches(
        data, seed=trainer["seed"], rank=rank, vocab_size=cfg["model"]["vocab_size"]
    )
    logger.info(
        "world %d, device %s, %s, %s, resumed from %s",
        world,
        device,
        cfg["parallel"]["strategy"],
        trainer["precision"],
        resumed_from,
    )
    with integrations.start_metrics(
        cfg["metrics"],
        scaler,
        model,
        run_dir=run_dir,
        rank=rank,
        local_rank=local_rank,
        log_every=trainer["log_every"],
    ):
        result = train(
            model=model,
            optimizer=optimizer,
            scaler=scaler,
            batches=batches,
            faults=Faults(cfg["fault"], rank, attempt),
            saver=checkpoints,
            state=state,
            max_steps=trainer["max_steps"],
            precision=trainer["precision"],
            device=device,
            progress=progress,
        )
        progress.close()
    checkpoints.close()
    return {
        "rank": rank,
        "final_scale": float(scaler.get_scale()),
        "skipped_steps": state.skipped_steps,
        "num_skipped": state.num_skipped,
        "steps": state.step,
        "resumed_from": resumed_from,
        "attempt": attempt,
        "losses": result.losses,
        "tokens_this_attempt": result.tokens * world,
        "seconds_this_attempt": result.seconds,
    }


@record
def worker_main(cfg: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """Train on this rank; rank 0 returns every rank's report, the others their own."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(run_dir)
    setup_logging(out, rank, attempt)
    # What this rank actually received, for humans and for the tests.
    (out / "logs" / f"rank{rank}.config.json").write_text(json.dumps(cfg, indent=2))
    device = pick_device(cfg["trainer"]["device"], local_rank)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=timedelta(seconds=cfg["launcher"]["pg_timeout_s"]),
        device_id=device if device.type == "cuda" else None,  # NCCL: bind the rank's GPU now
    )
    try:
        report = _run(cfg, out, rank, device, attempt)
        reports: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
    except Preempted as exc:
        logger.warning("%s; exiting with status %d to be restarted", exc, PREEMPTED_EXIT_CODE)
        sys.exit(PREEMPTED_EXIT_CODE)
    finally:
        dist.destroy_process_group()
    return {"ranks": reports} if rank == 0 else {"ranks": [report]}
