"""Build torchelastic's ``LaunchConfig`` the way ``torchrun`` would, and run the workers.

``LaunchConfig``'s own defaults differ from torchrun's (etcd rendezvous, 3 restarts, no
``OMP_NUM_THREADS``); this module applies torchrun's instead, so ``python -m launch`` behaves like
``torchrun`` given the same flags.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.run import parse_min_max_nnodes

from launch.schema import LauncherConfig, StartMethod
from launch.worker import RUN_DIR_ENV, worker_main

logger = logging.getLogger(__name__)


def launch_config(lc: LauncherConfig, nproc: int, run_dir: Path) -> LaunchConfig:
    """torchrun's ``run()`` + ``config_from_args()`` for our keys, with explicit values."""
    min_nodes, max_nodes = parse_min_max_nnodes(lc.nnodes)
    backend, endpoint, run_id = lc.rdzv_backend, lc.rdzv_endpoint, lc.rdzv_id
    rdzv_configs: dict[str, Any] = _parse_rendezvous_config(lc.rdzv_conf)
    if backend in ("static", "c10d") and not endpoint and max_nodes == 1:
        # torchrun --standalone: a private c10d store on a free port, so jobs never collide.
        backend, endpoint, run_id = "c10d", "127.0.0.1:0", str(uuid.uuid4())
    elif backend == "static":
        endpoint = endpoint or f"{lc.master_addr}:{lc.master_port}"
        rdzv_configs["rank"] = lc.node_rank
    # Ranks other than local rank 0 write to files only; local rank 0 keeps the terminal, so
    # its progress bar works. torchelastic's per-attempt folders hold the captured streams.
    redirects = {r: (Std.NONE if r == 0 else Std.ALL) for r in range(nproc)}
    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=run_id,
        role="default",
        rdzv_endpoint=endpoint,
        rdzv_backend=backend,
        rdzv_configs=rdzv_configs,
        max_restarts=lc.max_restarts,
        monitor_interval=lc.monitor_interval,
        start_method=StartMethod(lc.start_method).value,
        local_addr=lc.local_addr,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "torchelastic"), redirects=redirects),
    )


def cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def warn_oversubscribed(nproc: int, omp_threads: str | None) -> bool:
    """Log a warning when ``nproc`` ranks x ``OMP_NUM_THREADS`` threads exceed this node's cores."""
    try:
        threads = max(1, int(omp_threads or "1"))
    except ValueError:
        threads = 1
    have = cores()
    if nproc * threads <= have:
        return False
    logger.warning(
        "%d local ranks x %d threads (OMP_NUM_THREADS) = %d exceed the %d cores this node gives "
        "the job: the ranks will time-share and every step slows down; lower "
        "launcher.nproc_per_node or OMP_NUM_THREADS",
        nproc,
        threads,
        nproc * threads,
        have,
    )
    return True


def worker_env(nproc: int, run_dir: Path | None = None) -> None:
    """What torchrun puts in the environment, plus the fix for restarts on one node.

    ``DSCALE_RUN_DIR`` tells a script's ``launch.get_context()`` where the run folder (and its
    resolved config) is.

    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: on torch 2.13 a re-formed gloo group reads the
    previous attempt's keys from the shared rendezvous store and fails to connect or hangs
    (pytorch/pytorch#135712, #167288); a fresh store per attempt makes every restart work.
    """
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    warn_oversubscribed(nproc, os.environ.get("OMP_NUM_THREADS"))
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if run_dir is not None:
        os.environ[RUN_DIR_ENV] = str(run_dir)


def run_workers(config: LaunchConfig, cfg: dict[str, Any], run_dir: Path) -> dict[int, Any]:
    """Start the agent and the entrypoint's workers; return ``{global rank: return value}``.

    Only this node's ranks are in the result; the launcher's folder is passed on so the
    workers import the user's package from where ``dscale-launch`` was started.
    """
    results: dict[int, Any] = elastic_launch(config, worker_main)(cfg, str(run_dir), os.getcwd())
    return results


def run_script(config: LaunchConfig, script: str, script_args: list[str]) -> dict[int, Any]:
    """Run ``python -u SCRIPT ARGS`` on every rank, as torchrun does, with torchrun's env."""
    results: dict[int, Any] = elastic_launch(config, sys.executable)("-u", script, *script_args)
    return results


# torchelastic's loggers for worker processes: each failed rank's traceback, "Terminating process".
_PROCESS_LOGGERS = ("torch.distributed.elastic.multiprocessing", "torch.multiprocessing")


@contextlib.contextmanager
def process_logs_to_file(run_dir: Path) -> Iterator[Path]:
    """Send torchelastic's per-process failure logs to ``torchelastic/agent.log``, not the terminal.

    They print every failed rank's traceback as it is noticed, often a peer's consequence first;
    the launcher's report names the cause and this file once the ranks have stopped.
    """
    path = run_dir / "torchelastic" / "agent.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in _PROCESS_LOGGERS]
    saved = [lg.propagate for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
    try:
        yield path
    finally:
        for lg, propagate in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.propagate = propagate
        handler.close()
