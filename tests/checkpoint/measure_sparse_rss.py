"""Measure a load's peak memory from a checkpoint edited with a sparse file (issue 33 item 3).

Builds a one-process checkpoint in ROOT, applies one edit, loads it into fresh objects and prints
the outcome and the growth of the process's peak RSS (``ru_maxrss``) during the load:
``counter`` declares ``train.step`` as GIB GiB backed by a hole, ``value`` moves a pickled value
into a hole of GIB GiB, ``metadata`` makes ``.metadata`` a pickle opening GIB GiB of bytes in a
hole, ``tail`` adds a hole of GIB GiB after the last record, ``deflated`` replaces a weight's
record by a deflated zip unpacking GIB GiB behind a view of the weight's shape (no hole: a small
dense record), ``none`` edits nothing.

Run: PYTHONPATH=$PWD .venv/bin/python tests/checkpoint/measure_sparse_rss.py ROOT SCENARIO [GIB]
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from dscale.checkpoint import CheckpointError, CheckpointManager, load_checkpoint
from tests.checkpoint import _hostile
from tests.checkpoint._helpers import make_model, make_scaler, train


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build(root: Path, scenario: str, gib: float) -> None:
    """Save a checkpoint in ``root`` and apply the edit (in a process of its own)."""
    nbytes = int(gib * 2**30)
    shutil.rmtree(root, ignore_errors=True)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = make_scaler()
    train(model, opt, scaler, 3)
    CheckpointManager(root).save(4, model=model, optimizer=opt, scaler=scaler)
    folder = root / "step-4"
    if scenario == "counter":
        _hostile.sparse_counter(folder, "train.step", nbytes)
    elif scenario == "value":
        _hostile.sparse_value(folder, _hostile.a_pickled_value(folder, "optimizer."), nbytes)
    elif scenario == "metadata":
        _hostile.sparse_metadata(folder, nbytes)
    elif scenario == "tail":
        _hostile.sparse_tail(folder, "__0_0.distcp", nbytes)
    elif scenario == "deflated":
        storage = torch.zeros(nbytes // 4)
        _hostile.plant(folder, "model.0.weight", _hostile.deflated(storage[:32].view(8, 4)))
        del storage
    elif scenario != "none":
        known = "counter, value, metadata, tail, deflated, none"
        raise SystemExit(f"unknown scenario {scenario!r}: {known}")


def main(root: Path, scenario: str, gib: float) -> None:
    # Built in another process, so that this one's peak RSS is the load's alone.
    subprocess.run([sys.executable, __file__, "--build", str(root), scenario, str(gib)], check=True)
    folder = root / "step-4"
    on_disk = sum(os.stat(f).st_blocks * 512 for f in folder.iterdir())
    print(f"{scenario}: folder {on_disk} bytes on disk")
    fresh = make_model(seed=7)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    before, start = _peak(), time.perf_counter()
    try:
        print(
            "loaded step",
            load_checkpoint(
                folder, model=fresh, optimizer=fresh_opt, scaler=make_scaler(init_scale=8.0)
            ),
        )
    except CheckpointError as exc:
        print(type(exc).__name__, str(exc)[:300])
    grown = (_peak() - before) / 2**20
    print(f"{scenario}: peak RSS +{grown:.0f} MiB, load {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    step = build if sys.argv[1] == "--build" else main
    args = sys.argv[2:] if step is build else sys.argv[1:]
    step(Path(args[0]), args[1], float(args[2]) if len(args) > 2 else 0.3)
