"""The launcher's only contact with dscale: the scaler, metrics and checkpoints.

Each piece is built from its config node with plain keyword arguments, through the libraries'
public APIs: ``dscale.GradScaler``, ``dscale.metrics`` (exporter, JSONL log for
``python -m dscale.report``) and ``dscale.checkpoint.CheckpointManager``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dscale import GradScaler, StepGuard
from dscale.checkpoint import CheckpointManager, PreemptionGuard
from dscale.metrics import MetricsLog, start_exporter
from dscale.stats import track_numerics
from launch.preemption import Preempted
from launch.targets import published_target, scrape_host

logger = logging.getLogger(__name__)


#: The ``scaler.*`` fields a StepGuard takes (the rest are about the loss scale).
STEP_GUARD_FIELDS = (
    "enabled",
    "sync_free",
    "stuck_patience",
    "spike_signals",
    "spike_sigma",
    "spike_window",
    "spike_warmup",
)


def build_scaler(scaler: dict[str, Any], precision: str, device: torch.device) -> GradScaler:
    """fp16: ``dscale.GradScaler(**scaler)``; bf16 and fp32: a ``dscale.StepGuard`` (no scaling,
    the same agreed skip of non-finite and, with ``scaler.spike_signals``, spiking steps)."""
    if precision == "fp16":
        return GradScaler(device.type, **scaler)
    return StepGuard(device.type, **{k: scaler[k] for k in STEP_GUARD_FIELDS if k in scaler})


class Checkpoints:
    """``CheckpointManager`` from ``checkpoint.*``, bound to a model, optimizer and scaler.

    ``extra`` (more Statefuls) rides along; the context adds its record of skipped steps, so
    that survives restarts. With ``checkpoint.enabled=false`` every method does nothing and
    ``resume()`` returns None. On a signal in ``checkpoint.save_on_signals``, every rank saves
    at its next ``maybe_save()`` (the ranks agree there, once per step), waits until that save
    is published (``checkpoint.async_save`` included), and raises ``Preempted``, which the
    worker turns into the restartable exit status.
    """

    def __init__(
        self,
        cfg: dict[str, Any],
        *,
        model: nn.Module,
        optimizer: Any,
        scaler: Any,
        extra: Mapping[str, Any],
    ) -> None:
        self.enabled = bool(cfg["enabled"])
        self.resumed_from: int | None = None
        self._resume = cfg["resume"]
        self._states = {"model": model, "optimizer": optimizer, "scaler": scaler, "extra": extra}
        self._manager = (
            CheckpointManager(
                cfg["dir"],
                every=cfg["every"],
                keep=cfg["keep"],
                async_save=bool(cfg.get("async_save", False)),
            )
            if self.enabled
            else None
        )
        signals = cfg.get("save_on_signals") or []
        self._guard = PreemptionGuard(signals).__enter__() if self.enabled and signals else None

    def resume(self) -> int | None:
        """Load what ``checkpoint.resume`` names; return its step, or None for a fresh start."""
        if self._manager is not None:
            if not self._manager.every:  # resume() checks only then; the loop saves at the end
                self._manager.check_room(**self._states)
            self.resumed_from = self._manager.resume(self._resume, **self._states)
        return self.resumed_from

    def maybe_save(self, step: int) -> bool:
        """Save after ``step`` iterations if it is a multiple of ``checkpoint.every``.

        Call it on every rank after every step: it is also where the ranks agree on a
        preemption signal (one small all-reduce); then every rank saves now and raises
        ``Preempted``.
        """
        if self._manager is None:
            return False
        if self._guard is not None and self._guard.should_stop():
            self._manager.save(step, **self._states)
            # Published before the worker exits: it destroys the process group on the way
            # out, which an asynchronous save still in flight would need.
            self._manager.wait()
            raise Preempted(step)
        return self._manager.maybe_save(step, **self._states)

    def save(self, step: int) -> None:
        """Save after ``step`` iterations now (the final save; a repeat of a step is skipped).

        A step before the one this run resumed from is not saved: the state is the later one's,
        and a ``step-<step>`` folder holding it would be resumed as the wrong step.
        """
        if self._manager is None:
            return
        if self.resumed_from is not None and step < self.resumed_from:
            logger.warning(
                "not saving step %d: this run resumed from step %d, which is past it",
                step,
                self.resumed_from,
            )
            return
        self._manager.save(step, **self._states)

    def close(self) -> None:
        """Wait for a pending asynchronous save."""
        if self._manager is not None:
            self._manager.wait()
        if self._guard is not None:
            self._guard.__exit__(None, None, None)


@contextlib.contextmanager
def start_metrics(
    cfg: dict[str, Any],
    scaler: GradScaler,
    model: nn.Module,
    *,
    run_dir: Path,
    rank: int,
    local_rank: int,
    log_every: int,
    progress: Any = None,
    attempt: int = 0,
    job_name: str | None = None,
) -> Iterator[Any]:
    """Serve this rank's metrics on ``port + local_rank`` and log them under ``run_dir/metrics``.

    The exporter lingers ``metrics.linger_s`` after the block so a scraper sees the final values.
    Labels: ``job_name`` the run's name (default: the run folder's), ``attempt``; the
    progress's training figures are served with the scaler's.
    """
    if not cfg["enabled"] or not scaler.is_enabled():
        yield None
        return
    stats = track_numerics(scaler, model)
    log = MetricsLog(run_dir, stats=stats, rank=rank, every=log_every)
    scaler.add_observer(log)
    if progress is not None:
        progress.loss_log = log  # rank 0's progress lines also go to metrics/loss-rank0.jsonl
        progress.stats = stats  # a StepGuard's progress lines show the grad norm
    writer = None
    if cfg.get("tensorboard") and progress is not None:
        from torch.utils.tensorboard import SummaryWriter  # validate.py checked it is there

        writer = SummaryWriter(str(run_dir / "tensorboard" / f"rank{rank}"))

        def scalars(step: int, values: dict[str, float], w: Any = writer) -> None:
            for name, value in values.items():
                w.add_scalar(name.removeprefix("dscale_"), value, step)

        progress.scalars = scalars
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or "dscale"
    job_name = job_name or run_dir.name
    try:
        with contextlib.ExitStack() as stack:
            exporter = start_exporter(
                scaler,
                stats,
                addr=cfg["addr"],
                port=cfg["port"],
                rank=rank,
                local_rank=local_rank,
                job_name=job_name,
                attempt=attempt,
                training=getattr(progress, "figures", None),
                linger_s=cfg["linger_s"],
                check_agreement_every=cfg["check_agreement_every"],
            )
            # Published only once the port is bound (exporter.port is None when it was not),
            # and removed after the exporter has stopped lingering.
            stack.enter_context(
                published_target(
                    cfg.get("targets_dir"),
                    run_id=run_id,
                    host=scrape_host(cfg["addr"]),
                    port=exporter.port,
                    rank=rank,
                    job_name=job_name,
                )
            )
            stack.enter_context(exporter)
            yield exporter
    finally:
        if progress is not None:
            progress.loss_log = None
            progress.scalars = None
        if writer is not None:
            writer.close()
        log.close()
