"""Per-rank set-up, then the user's function (``entrypoint=``) or, for scripts, the context.

This is the only launcher module that calls ``init_process_group``. It receives the resolved config
as a plain dict (no Hydra in workers) and the run folder the parent chose, so ranks never create
output folders of their own.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from launch import integrations
from launch.context import RunContext
from launch.entrypoint import load_entrypoint
from launch.faults import Faults
from launch.mesh import build_mesh
from launch.other_scaler import follow_the_scaler_used
from launch.preemption import PREEMPTED_EXIT_CODE, Preempted
from launch.progress import Progress, RankZeroProgress
from launch.record import SkipRecord

logger = logging.getLogger(__name__)

# Set by the launcher for its workers: the run folder, whose config.resolved.yaml a script's
# get_context() reads.
RUN_DIR_ENV = "DSCALE_RUN_DIR"

_current: RunContext | None = None


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


def pick_device(name: str, local_rank: int, local_ranks: int = 1) -> torch.device:
    """``auto``: this rank's own GPU when every local rank has one, else the CPU.

    NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so ``auto`` with more local
    ranks than GPUs runs on the CPU (gloo) and says why; ``cuda`` there is an error naming the fix.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "cuda" and gpus < local_ranks:
        raise RuntimeError(
            f"trainer.device=cuda with {local_ranks} ranks on this node but {gpus} GPU(s): NCCL "
            "needs a GPU per rank. Set launcher.nproc_per_node to at most the GPU count, or "
            "trainer.device=cpu (or auto) to run on the CPU with gloo"
        )
    if name == "cuda" or (name == "auto" and gpus >= local_ranks):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if name == "auto" and gpus and local_rank == 0:
        logger.warning(
            "trainer.device=auto: %d ranks on this node but %d GPU(s), and NCCL needs a GPU per "
            "rank: running on the CPU with gloo. Set launcher.nproc_per_node=%d to use the GPUs",
            local_ranks,
            gpus,
            gpus,
        )
    return torch.device("cpu")


def start_rank(cfg: dict[str, Any], run_dir: Path) -> RunContext:
    """Logging, device, process group (unless the caller made one), seeds; then the context."""
    global _current
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    setup_logging(run_dir, rank, attempt)
    # What this rank actually received, for humans and for the tests.
    (run_dir / "logs" / f"rank{rank}.config.json").write_text(json.dumps(cfg, indent=2))
    trainer = cfg["trainer"]
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = pick_device(trainer["device"], local_rank, local_ranks)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=cfg["launcher"]["pg_timeout_s"]),
            device_id=device if device.type == "cuda" else None,  # NCCL: bind the GPU now
        )
    # Every rank builds the mesh here, together (it makes the process groups of its dims).
    mesh = build_mesh(cfg["parallel"], dist.get_world_size(), device)
    # The same initial weights on every rank; per-rank data seeds are the user's choice.
    torch.manual_seed(trainer["seed"])
    random.seed(trainer["seed"])
    scaler = integrations.build_scaler(cfg["scaler"], trainer["precision"], device)
    skips = SkipRecord()
    skips.attach(scaler)
    progress_type = RankZeroProgress if rank == 0 else Progress
    _current = RunContext(
        rank=rank,
        local_rank=local_rank,
        world_size=dist.get_world_size(),
        node_rank=int(os.environ.get("GROUP_RANK", "0")),
        attempt=attempt,
        device=device,
        run_dir=run_dir,
        args=OmegaConf.create(cfg["args"]),
        config=cfg,
        scaler=scaler,
        faults=Faults(cfg["fault"], rank, attempt),
        progress=progress_type(trainer["max_steps"], trainer["log_every"], scaler, skips),
        record=skips,
        mesh=mesh,
    )
    return _current


def get_context() -> RunContext:
    """The run context inside ``dscale-launch script=train.py``: one call, from any rank.

    The first call sets up logging, the device, the process group (unless the script already
    called ``init_process_group``) and the seeds, as for an entrypoint; later calls return the
    same object. Inside an entrypoint it returns the context the function was given.
    """
    if _current is not None:
        return _current
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        raise RuntimeError(
            "get_context() works in processes started by dscale-launch (script= or "
            f"entrypoint=); {RUN_DIR_ENV} is not set here"
        )
    resolved = OmegaConf.load(Path(run_dir) / "config.resolved.yaml")
    cfg: Any = OmegaConf.to_container(resolved, resolve=True)
    ctx = start_rank(cfg, Path(run_dir))
    watch = follow_the_scaler_used(ctx)
    watch.__enter__()
    atexit.register(_close_script_context, watch)
    return ctx


def script_report_path(run_dir: Path, rank: int) -> Path:
    """Where a script's rank leaves its ``summary.json`` record (written when it exits)."""
    return run_dir / "logs" / f"rank{rank}.report.json"


def _close_script_context(watch: Any) -> None:
    if _current is not None:
        _current.progress.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    # After the group is gone (the ranks leave it together, as before this record existed), the
    # launcher's record for summary.json: the scale and skips of the scaler the script used.
    watch.__exit__(None, None, None)
    if _current is not None:
        path = script_report_path(_current.run_dir, _current.rank)
        path.write_text(json.dumps(_current.report(None), default=repr))


@record
def worker_main(cfg: dict[str, Any], run_dir: str, cwd: str) -> dict[str, Any]:
    """Run the entrypoint on this rank; rank 0 returns every rank's report, the others their own."""
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # find the user's package as `python -m` would
    ctx = start_rank(cfg, Path(run_dir))
    # No try/finally: on an error, @record must write this rank's error file before the group
    # closes, or the peers' "connection closed" errors would look older than the cause.
    function = load_entrypoint(cfg["entrypoint"])
    logger.info(
        "rank %d of %d on %s: calling %s",
        ctx.rank,
        ctx.world_size,
        ctx.device,
        cfg["entrypoint"],
        extra={"console": False},
    )
    try:
        with follow_the_scaler_used(ctx):
            result = function(ctx)
    except Preempted as exc:
        logger.warning("%s; exiting with status %d to be restarted", exc, PREEMPTED_EXIT_CODE)
        dist.destroy_process_group()
        sys.exit(PREEMPTED_EXIT_CODE)
    except Exception:
        # To this rank's log only: on the console, rank 0's error is often a peer's consequence
        # ("Connection closed by peer"); the launcher names the cause once the ranks have stopped.
        logger.exception(
            "rank %d: %s raised", ctx.rank, cfg["entrypoint"], extra={"console": False}
        )
        raise
    ctx.progress.close()
    report = ctx.report(result)
    reports: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(reports, report)
    dist.destroy_process_group()
    return {"ranks": reports} if ctx.rank == 0 else {"ranks": [report]}
