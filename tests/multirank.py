"""run_ranks(): run a function on N gloo ranks in fresh processes and return every rank's result.

Rendezvous goes through a FileStore in a temp dir (no ports to race for). The process group and the
whole run have timeouts; the first failure ends the other ranks and every rank's traceback is
reported. Spawning costs 3-5 s on a 2-core machine, so check several scenarios inside one call.

The ranks are forked from a forkserver that imported torch once (per test process), not spawned:
a spawned rank spends seconds of CPU importing torch before it runs a line of the test. Each rank
gets the caller's environment, working directory and sys.path as a spawned one would.
"""

from __future__ import annotations

import io
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: How the ranks start: forked from a server that imported these once (see the module's docstring).
START_METHOD = "forkserver"
PRELOAD = ["torch", "torch.distributed"]


def _rank_main(
    rank: int,
    world_size: int,
    store_path: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    pg_timeout_s: float,
    caller: tuple[dict[str, str], str, list[str]],
) -> None:
    # The forkserver's environment, folder and sys.path are those of the test that started it:
    # take the caller's, as a spawned process would.
    env, cwd, path = caller
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=pg_timeout_s),
    )
    status = 1
    try:
        value = fn(rank, world_size, *args)
        # Through bytes: tensors sent as-is would share memory with a process about to exit.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
        status = 0
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()
        results.close()
        results.join_thread()  # the result is in the pipe before this process goes
    # gloo ranks that ran DDP/FSDP2 sometimes abort in C++ teardown after the last Python frame
    # ("terminate called without an active exception"); the result is sent, so skip destructors.
    os._exit(status)


def _drain(results: Any, outcome: dict[int, tuple[str, Any]], wait_s: float) -> None:
    """Move every result waiting in ``results`` into ``outcome``, waiting ``wait_s`` for each."""
    while True:
        try:
            rank, status, value = results.get(timeout=wait_s) if wait_s else results.get_nowait()
        except queue.Empty:
            return
        outcome[rank] = (status, value)


def run_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout_s: float = 180.0,
    pg_timeout_s: float = 60.0,
) -> dict[int, Any]:
    """Run ``fn(rank, world_size, *args)`` on every rank (gloo); return ``{rank: result}``.

    ``fn`` must be importable (a module-level function) and its result picklable.
    """
    ctx_mp = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx_mp.set_forkserver_preload(PRELOAD)  # read once, when the server starts
    results = ctx_mp.Queue()
    caller = (dict(os.environ), os.getcwd(), list(sys.path))
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            _rank_main,
            nprocs=world_size,
            join=False,
            start_method=START_METHOD,
            args=(world_size, os.path.join(tmp, "store"), fn, args, results, pg_timeout_s, caller),
        )
        deadline = time.monotonic() + timeout_s
        failure = ""
        outcome: dict[int, tuple[str, Any]] = {}
        try:
            # Results are read while waiting: a rank whose result is larger than the pipe's
            # buffer blocks in join_thread() until someone reads, so joining first would hang.
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                _drain(results, outcome, wait_s=0.0)
                if time.monotonic() >= deadline:
                    failure = f"{fn.__name__} did not finish on {world_size} ranks in {timeout_s}s"
                    break
        except mp.ProcessRaisedException as exc:
            failure = f"{fn.__name__} raised on a rank: {exc}"
        except mp.ProcessExitedException as exc:
            failure = f"{fn.__name__}: a rank exited abnormally: {exc}"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(timeout=10)

        _drain(results, outcome, wait_s=0.5)

    errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
    if failure or errors or len(outcome) != world_size:
        report = [failure or f"{fn.__name__} failed"]
        for r in range(world_size):
            status, value = outcome.get(r, ("missing", "no result (killed or hung)"))
            if status != "ok":
                report.append(f"--- rank {r} ({status}) ---\n{value}")
        raise AssertionError("\n".join(report))
    return {
        r: torch.load(io.BytesIO(v), weights_only=False) for r, (_, v) in sorted(outcome.items())
    }
