"""Nothing lost: an async save survives a preemption exit, a failed async publish raises on every
rank promptly, and a folder that cannot take a checkpoint fails before any training.

2 gloo ranks on 127.0.0.1, bounded timeouts; the recipe runs as two real processes so that they
exit as a preempted job does (the spawn harness ends its ranks with os._exit).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dscale.checkpoint import PREEMPTED_EXIT_CODE, CheckpointManager, load_checkpoint
from tests.checkpoint import _lost_ranks
from tests.checkpoint._helpers import make_model, make_scaler
from tests.multirank import run_ranks
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def test_readme_recipe_with_async_save_publishes_the_preemption_save_on_every_rank(tmp_path):
    """Leaving the PreemptionGuard after a preemption publishes the save in flight. Before, the
    ranks exited 75 leaving only .step-6.tmp; a restart resumed from step 4 and deleted it."""
    port = free_port()
    command = [sys.executable, "-m", "tests.checkpoint._preempted_async", "guard"]
    procs = [
        subprocess.Popen(
            [*command, str(r), str(port), str(tmp_path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == PREEMPTED_EXIT_CODE, f"rank {rank}: {out}{err[-3000:]}"
        assert f"rank {rank}: exiting after saving step 6" in out
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-4", "step-6"], names
    model = make_model(seed=9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    resumed = CheckpointManager(tmp_path).resume(
        "auto", model=model, optimizer=opt, scaler=make_scaler()
    )
    assert resumed == 6


def test_an_async_save_in_flight_at_sys_exit_is_published_at_exit(tmp_path):
    """Without a guard or wait(): published at interpreter exit. Before: only .step-3.tmp."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.checkpoint._preempted_async", "exit", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == PREEMPTED_EXIT_CODE, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]
    assert load_checkpoint(tmp_path / "step-3", model=make_model(seed=9)) == 3


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lost"))
    return run_ranks(
        _lost_ranks.failures_before_and_after_training,
        root,
        world_size=2,
        timeout_s=180,
        pg_timeout_s=60,
    )


@pytest.mark.parametrize("path", ["wait", "maybe_save"])
def test_a_failed_async_publish_raises_the_same_named_error_on_every_rank_promptly(results, path):
    """Before, rank 0 raised a bare OSError and rank 1 waited in a barrier until the
    process-group timeout (60 s here)."""
    assert results[0][path] is not None and results[0][path] == results[1][path]
    kind, message = results[0][path]
    assert kind == "CheckpointSaveError", message
    assert "simulated failure renaming" in message and "rank(s) 0" in message, message
    for rank in (0, 1):
        assert results[rank][f"{path}_seconds"] < 20, results[rank]
    assert results[0]["left_in_wait"] == []  # the unpublished folder was removed


def test_an_unwritable_checkpoint_folder_fails_on_every_rank_before_training(results):
    """Before, resume() found nothing to load and training went on until the first save."""
    for rank in (0, 1):
        kind, message = results[rank]["unwritable"]
        assert kind == "CheckpointSaveError"
        assert f"checkpoint folder {_lost_ranks.UNWRITABLE} is not writable" in message, message
        assert "nothing was trained" in message and "Pass a checkpoint directory" in message
    assert results[0]["unwritable"] == results[1]["unwritable"]


def test_a_folder_without_room_for_one_checkpoint_fails_on_every_rank_before_training(results):
    for rank in (0, 1):
        kind, message = results[rank]["full"]
        assert kind == "CheckpointSaveError"
        # keep=2 (the default): 3 at the peak of a save (old code: checked room for one).
        assert "has 1.0 kB free, but 3 checkpoints (keep=2, and the next one is written" in (
            message
        ), message
        assert "Free space there" in message
        assert results[rank]["fine"] is None
        assert results[rank]["fresh_optimizer_state"] == 0


def test_the_launchers_preemption_save_is_published_before_the_worker_exits_with_async_save(
    results,
):
    """checkpoint.async_save=true (new): every rank saves step 3 in the background and waits
    until it is published before raising Preempted (the worker then destroys the group)."""
    for rank in (0, 1):
        assert results[rank]["launcher_async"]
        assert results[rank]["launcher_preempted"] == "preempted: saved a checkpoint at step 3"
        assert results[rank]["launcher_published"] == ["step-3"]
