"""Per-rank bodies for "nothing lost": failed asynchronous publishes, and unusable folders."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import torch

from dscale.checkpoint import CheckpointManager, _publish, _save
from tests.checkpoint._helpers import make_model, make_scaler, train

# Not a folder anyone can create, root included (sysfs refuses).
UNWRITABLE = "/sys/dscale-test-unwritable/ckpt"


def _error(call: Any) -> tuple[str, str] | None:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def failures_before_and_after_training(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 0 cannot publish an async save (through wait(), then through maybe_save());
    then folders that cannot take a checkpoint, checked by resume() before any training."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = make_scaler()
    train(model, opt, scaler, 2, seed=1 + rank)
    states = {"model": model, "optimizer": opt, "scaler": scaler}
    out: dict[str, Any] = {}

    def failing_publish(tmp: Any, final: Any) -> None:
        raise OSError(f"simulated failure renaming {tmp}")

    real_publish = _publish.publish
    if rank == 0:
        _publish.publish = failing_publish
    try:
        ckpt = CheckpointManager(f"{root}/wait", async_save=True)
        ckpt.save(2, **states)
        started = time.monotonic()
        out["wait"] = _error(ckpt.wait)
        out["wait_seconds"] = time.monotonic() - started
        ckpt = CheckpointManager(f"{root}/maybe", every=2, async_save=True)
        ckpt.maybe_save(2, **states)
        assert ckpt._pending is not None
        ckpt._pending.future.result()  # this rank's part is written; the next step publishes
        started = time.monotonic()
        out["maybe_save"] = _error(lambda: ckpt.maybe_save(3, **states))
        out["maybe_save_seconds"] = time.monotonic() - started
    finally:
        _publish.publish = real_publish
    out["left_in_wait"] = sorted(p.name for p in Path(f"{root}/wait").iterdir())

    # The launcher's binding with checkpoint.async_save=true: a signal on rank 1 only.
    from launch.integrations import Checkpoints
    from launch.preemption import Preempted

    cfg = {
        "enabled": True,
        "dir": f"{root}/launcher",
        "every": 1000,
        "keep": 2,
        "resume": "auto",
        "save_on_signals": ["SIGUSR1"],
        "async_save": True,
    }
    binding = Checkpoints(cfg, model=model, optimizer=opt, scaler=scaler, extra={})
    out["launcher_async"] = binding._manager is not None and binding._manager.async_save
    if rank == 1:
        signal.raise_signal(signal.SIGUSR1)
    try:
        binding.maybe_save(3)
        out["launcher_preempted"] = None
    except Preempted as exc:
        out["launcher_preempted"] = str(exc)
    # What a restart would find, before this process does anything else.
    out["launcher_published"] = sorted(p.name for p in Path(cfg["dir"]).iterdir())
    binding.close()

    fresh = make_model(seed=3)
    fresh_states = {
        "model": fresh,
        "optimizer": torch.optim.Adam(fresh.parameters()),
        "scaler": make_scaler(),
    }
    out["unwritable"] = _error(
        lambda: CheckpointManager(UNWRITABLE, every=5).resume("auto", **fresh_states)
    )
    real_free = _save._free_bytes
    _save._free_bytes = lambda folder: 1000  # a nearly full filesystem
    try:
        out["full"] = _error(
            lambda: CheckpointManager(f"{root}/full", every=5).resume("auto", **fresh_states)
        )
    finally:
        _save._free_bytes = real_free
    out["fine"] = _error(
        lambda: CheckpointManager(f"{root}/fine", every=5).resume("auto", **fresh_states)
    )
    # The check made no optimizer state (DCP makes it by a zero-lr step, which shifts Adam).
    out["fresh_optimizer_state"] = len(fresh_states["optimizer"].state)
    return out
