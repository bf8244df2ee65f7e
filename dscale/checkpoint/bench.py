"""Checkpoint throughput: dscale's verified save and load against plain DCP, on N CPU ranks.

Run::

    python -m dscale.checkpoint.bench --size-gb 2 --ranks 1 --dir /path/on/the/disk/to/test

Each rank saves and loads its own ``size_gb / ranks`` of float32 tensors. "plain DCP" is
``dcp.save`` with the same FileSystemWriter settings (one file per rank, fsync) and an in-place
``dcp.load``; "dscale" adds the per-rank CRC32 of every file, the manifest, the atomic publish,
and on load the empty copies, the checksums of each rank's share and every check. Saves and
loads alternate between the two (who goes first alternates too, and each starts after
``sync``), ``--repeats`` times; the median is reported, in MB/s of checkpoint data (all ranks
together). Loads read files just written, mostly from the page cache
unless ``--drop-caches`` (root only) empties it before each load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from dscale import _dist
from dscale.checkpoint._hashing import writer_threads
from dscale.checkpoint._load import load_checkpoint
from dscale.checkpoint._manager import CheckpointManager
from dscale.checkpoint._quiet import quiet_single_process

_TENSOR_MB = 64


class _Holder:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, Any]:
        return self.tensors

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for k, v in state_dict.items():
            self.tensors[k].copy_(v)


def _drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _timed(fn: Any, group: Any) -> float:
    _dist.barrier(group)
    start = time.perf_counter()
    fn()
    _dist.barrier(group)
    return time.perf_counter() - start


def _one_round(
    root: Path, repeat: int, holder: _Holder, world: int, drop_caches: bool
) -> dict[str, float]:
    """Save and load once with plain DCP and once with dscale; seconds for each."""
    plain, ours = root / f"plain-{repeat}", root / f"dscale-{repeat}"
    no_dist = world == 1
    writer = FileSystemWriter(
        plain,
        single_file_per_rank=True,
        sync_files=True,
        thread_count=writer_threads(),  # the same files per rank as dscale writes
        overwrite=True,
    )
    manager = CheckpointManager(ours, keep=1)
    steps = {
        "plain_save": lambda: dcp_save({"data": holder}, storage_writer=writer, no_dist=no_dist),
        "dscale_save": lambda: manager.save(repeat + 1, extra={"data": holder}),
        "plain_load": lambda: dcp_load(
            {"data": holder}, storage_reader=FileSystemReader(plain), no_dist=no_dist
        ),
        "dscale_load": lambda: load_checkpoint(ours / f"step-{repeat + 1}", extra={"data": holder}),
    }
    # Alternate who goes first, and start each from clean page-cache state: a save that
    # follows another pays for the writeback of the first one's dirty pages.
    order = ["plain_save", "dscale_save", "plain_load", "dscale_load"]
    if repeat % 2:
        order = ["dscale_save", "plain_save", "dscale_load", "plain_load"]
    times = {}
    for kind in order:
        os.sync()
        if drop_caches and kind.endswith("load") and _dist.rank() == 0:
            _drop_caches()
        with quiet_single_process():
            times[kind] = _timed(steps[kind], None)
    _dist.barrier(None)
    if _dist.rank() == 0:
        shutil.rmtree(plain, ignore_errors=True)
        shutil.rmtree(ours, ignore_errors=True)
    return times


def _rank_main(rank: int, world: int, store: str, args: argparse.Namespace, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if world > 1:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store, world),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=1800),
        )
    per_rank = int(args.size_gb * 1e9 / world)
    numel = _TENSOR_MB * 2**20 // 4
    gen = torch.Generator().manual_seed(rank)
    tensors = {
        f"r{rank}.t{i}": torch.rand(numel, generator=gen)
        for i in range(max(1, per_rank // (numel * 4)))
    }
    total = sum(t.nbytes for t in tensors.values()) * world
    holder = _Holder(tensors)
    root = Path(args.dir)
    times: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        for kind, seconds in _one_round(root, repeat, holder, world, args.drop_caches).items():
            times.setdefault(kind, []).append(seconds)
    if rank == 0:
        out.put({"bytes": total, "times": times})
    if world > 1:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size (all ranks)")
    parser.add_argument("--ranks", type=int, default=1, help="CPU (gloo) ranks")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--drop-caches", action="store_true", help="cold loads (needs root)")
    args = parser.parse_args()
    keep_dir = args.dir is not None
    args.dir = args.dir or tempfile.mkdtemp(prefix="dscale-ckpt-bench-")
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank_main,
            args=(args.ranks, os.path.join(tmp, "store"), args, out),
            nprocs=args.ranks,
            start_method="spawn",
        )
    result = out.get()
    if not keep_dir:
        shutil.rmtree(args.dir, ignore_errors=True)
    mb = result["bytes"] / 1e6
    report: dict[str, Any] = {"size_mb": round(mb), "ranks": args.ranks, "load": os.getloadavg()}
    for kind, seconds in result["times"].items():
        median = statistics.median(seconds)
        report[kind] = {"seconds": round(median, 2), "MB_per_s": round(mb / median)}
    for op in ("save", "load"):
        plain, ours = report[f"plain_{op}"]["seconds"], report[f"dscale_{op}"]["seconds"]
        report[f"{op}_overhead_pct"] = round(100 * (ours - plain) / plain, 1)
    print(json.dumps(report, indent=2))  # noqa: T201 - a command-line tool's output


if __name__ == "__main__":
    main()
