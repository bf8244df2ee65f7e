"""The run context: what the launcher set up on a rank, handed to the user's function.

``dscale-launch entrypoint=my_pkg.train:main`` calls ``main(ctx)`` on every rank once the process
group, device, logging, run folder and seeds are ready; a ``script=`` gets the same object from
``launch.get_context()``. Everything here is built from the job's config nodes, so the user's
code does not read config files or environment variables itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from collections.abc import Callable

    from launch.pipeline import Pipeline, Split

from dscale import GradScaler, StepGuard
from launch import integrations
from launch.faults import Faults
from launch.mesh import data_parallel
from launch.parallel import wrap_model
from launch.progress import Progress
from launch.record import SkipRecord

# Set by the launcher: the run's name (hydra.job.name), stable across restarts and reruns, which
# labels the metrics (job_name).
JOB_NAME_ENV = "DSCALE_JOB_NAME"

DTYPES = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp8": torch.bfloat16,  # bf16 autocast around torchao's float8 linears
}


def _spike_skips(scaler: GradScaler) -> int | None:
    """The spike gate's skipped steps, or None without ``scaler.spike_signals``."""
    spikes = scaler.snapshot().get("spike_skipped_steps")
    return None if spikes is None else int(spikes)


@dataclass
class RunContext:
    """One rank's view of the job.

    Attributes:
        rank, local_rank, world_size: as torchrun's RANK, LOCAL_RANK, WORLD_SIZE.
        node_rank: this node's rank among the nodes (torchrun's GROUP_RANK).
        attempt: how many times the workers were restarted before this attempt.
        device: this rank's device (its GPU when CUDA is there and ``trainer.device=auto``).
        run_dir: the run folder (logs, metrics, summary.json; checkpoints by default).
        args: the user's ``args`` node (``ctx.args.lr``), from the command line and their YAML.
        config: the whole resolved job config, as plain dicts.
        scaler: a ``dscale.GradScaler`` from ``scaler.*``, enabled when ``trainer.precision``
            is fp16.
        faults: ``fault.*``; call ``faults.after_backward(step, model)`` after ``backward()``
            and ``faults.before_step(step)`` at the top of a step.
        progress: rank 0's progress bar and log lines (silent on other ranks).
        record: the steps this rank skipped, recorded from the scaler, checkpointed by
            :meth:`checkpoints`, and reported in ``summary.json``.
        mesh: the job's ``DeviceMesh`` from ``parallel.*`` (dims ``dp``; ``tp``; ``dp``,
            ``tp``; ``dp_replicate``, ``dp_shard``; ``pp``), None for ``parallel=single``.

    Example::

        def main(ctx):
            model = ctx.parallelize(MyModel())
            opt = torch.optim.SGD(model.parameters(), lr=ctx.args.lr)
            ckpt = ctx.checkpoints(model, opt)
            start = ckpt.resume() or 0
            with ctx.metrics(model, opt):
                for step in range(start, ctx.max_steps):
                    with ctx.autocast():
                        loss = model(batch(step)).float().mean()
                    ctx.scaler.scale(loss).backward()
                    ctx.faults.after_backward(step, model)
                    ctx.scaler.step(opt)
                    ctx.scaler.update()
                    opt.zero_grad()
                    ckpt.maybe_save(step + 1)
            ckpt.save(ctx.max_steps)
            return {"final_loss": loss.item()}  # goes into summary.json
    """

    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    attempt: int
    device: torch.device
    run_dir: Path
    args: DictConfig
    config: dict[str, Any]
    scaler: GradScaler
    faults: Faults
    progress: Progress
    record: SkipRecord
    mesh: DeviceMesh | None = None
    _checkpoints: list[integrations.Checkpoints] = field(default_factory=list, repr=False)
    _fp8_conversion: Any = field(default=None, repr=False)
    _fp8_parts: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def precision(self) -> str:
        """``trainer.precision``: fp16, bf16, fp32 or fp8."""
        return str(self.config["trainer"]["precision"])

    @property
    def dtype(self) -> torch.dtype:
        """The autocast dtype of ``trainer.precision``."""
        return DTYPES[self.precision]

    @property
    def max_steps(self) -> int:
        """``trainer.max_steps``, which ``fault.inf_steps`` and the progress bar refer to."""
        return int(self.config["trainer"]["max_steps"])

    @property
    def seed(self) -> int:
        """``trainer.seed``; torch and Python's ``random`` were seeded with it on every rank."""
        return int(self.config["trainer"]["seed"])

    @property
    def resumed_from(self) -> int | None:
        """The step the first checkpoint binding resumed from, or None."""
        return self._checkpoints[0].resumed_from if self._checkpoints else None

    def autocast(self) -> torch.autocast:
        """``torch.autocast`` on this device in ``trainer.precision`` (off for fp32)."""
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.precision != "fp32")

    @property
    def data_rank(self) -> int:
        """This rank's index among the data-parallel replicas: the seed of its own batches.

        The ranks of one tensor-parallel group, or of one pipeline, share it (and the batch).
        """
        return data_parallel(self.mesh)[0]

    @property
    def data_ranks(self) -> int:
        """How many different batches a step sees: the data-parallel degree of the mesh."""
        return data_parallel(self.mesh)[1]

    def parallelize(self, model: nn.Module, *, tp_plan: dict[str, Any] | None = None) -> nn.Module:
        """Move ``model`` to the device and wrap it as ``parallel.strategy`` says, on ``mesh``.

        ``tp_plan``: with ``parallel=tp`` or ``2d``, ``parallelize_module``'s plan for your model
        (the demo GPT has its own). ``parallel=pp`` takes :meth:`pipeline` instead.
        """
        if self.precision == "fp8":  # float8 linears first: DDP and FSDP2 wrap the result
            from launch.fp8 import convert

            self._fp8_conversion = convert(model, self.config.get("fp8", {}), self.device)
        strategy = self.config["parallel"]["strategy"]
        return wrap_model(model, strategy, self.device, self.mesh, tp_plan)

    def pipeline(
        self,
        model: nn.Module,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        split: Split | None = None,
    ) -> Pipeline:
        """``parallel=pp``: this rank's stage of ``model`` and the schedule (``parallel.*``).

        ``loss_fn(output, target)`` is the unscaled loss of one microbatch; the pipeline scales
        it. ``split(model, stage_index, num_stages)`` gives a stage's module (the demo GPT has
        its own split). Use ``pipeline.module`` as the model (optimizer, checkpoints, metrics,
        faults) and ``loss = pipeline.step(inputs, targets)`` for the forward and backward.
        """
        parallel = self.config["parallel"]
        if parallel["strategy"] != "pp" or self.mesh is None:
            raise ValueError(
                f"ctx.pipeline() needs parallel=pp (this job has parallel={parallel['strategy']}); "
                "use ctx.parallelize(model)"
            )
        from launch.pipeline import Pipeline

        return Pipeline(
            model,
            loss_fn,
            mesh=self.mesh,
            schedule=parallel["schedule"],
            microbatches=parallel["microbatches"],
            scaler=self.scaler,
            device=self.device,
            split=split,
        )

    def fp8_parts(self, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        """``trainer.precision=fp8``: what dscale.fp8 adds, made once from ``fp8.*``.

        ``fp8_weight_scales`` (``fp8.float8_all_gather``), ``fp8_numerics``
        (``fp8.numerics_every``) and ``fp8_fallback`` (``fp8.fallback``), by checkpoint key;
        :meth:`checkpoints` calls it, so their state is saved and resumed. {} for other jobs.
        Call it on every rank after :meth:`parallelize`, with the model it returned.
        """
        if self._fp8_parts is None:
            self._fp8_parts = {}
            if self._fp8_conversion is not None:
                from launch.fp8 import build_parts

                self._fp8_parts = build_parts(
                    model, optimizer, self.scaler, self._fp8_conversion, self.config["fp8"]
                )
        return self._fp8_parts

    def checkpoints(
        self, model: nn.Module, optimizer: Any, *, extra: dict[str, Any] | None = None
    ) -> integrations.Checkpoints:
        """A checkpoint manager from ``checkpoint.*`` bound to model, optimizer and ``scaler``.

        ``resume()`` honours ``checkpoint.resume``; ``maybe_save(step)`` saves every
        ``checkpoint.every`` steps; ``save(step)`` at the end; ``close()`` waits for a pending
        save. ``extra`` adds Statefuls of your own (an LR scheduler, a data-loader position).
        An fp8 job's :meth:`fp8_parts` are made here (if not yet) and ride along.
        """
        binding = integrations.Checkpoints(
            self.config["checkpoint"],
            model=model,
            optimizer=optimizer,
            scaler=self.scaler,
            extra={
                **(extra or {}),
                **self.fp8_parts(model, optimizer),
                "dscale_launch_record": self.record,
            },
        )
        self._checkpoints.append(binding)
        return binding

    @contextlib.contextmanager
    def metrics(self, model: nn.Module, optimizer: Any = None) -> Iterator[Any]:
        """Serve this rank's Prometheus metrics for ``model`` and log them, as ``metrics.*`` says.

        Rank r serves on ``metrics.port`` + local rank, labelled with the run's name
        (``job_name``, stable across reruns) and ``attempt``; the per-step log goes to
        ``run_dir/metrics/rank<r>.jsonl``. What the loop gives ``progress.update()`` (step, loss,
        tokens/s, step time) and ``optimizer``'s learning rate are served too. Yields the
        exporter (None when metrics are off or the scaler is disabled).
        """
        self.progress.figures.optimizer = optimizer
        with integrations.start_metrics(
            self.config["metrics"],
            self.scaler,
            model,
            run_dir=self.run_dir,
            rank=self.rank,
            local_rank=self.local_rank,
            log_every=self.config["trainer"]["log_every"],
            progress=self.progress,
            attempt=self.attempt,
            job_name=os.environ.get(JOB_NAME_ENV),
        ) as exporter:
            yield exporter

    def report(self, result: Any) -> dict[str, Any]:
        """What the launcher records for this rank in ``summary.json``, with ``result``."""
        enabled = self.scaler.is_enabled()
        return {
            "rank": self.rank,
            "final_scale": float(self.scaler.get_scale()),
            # False for a StepGuard (bf16, fp32, fp8): its scale is fixed at 1, not a loss scale.
            "loss_scaling": not isinstance(self.scaler, StepGuard),
            # With scaler.spike_signals: how many of the skipped steps were spikes.
            "num_spike_skipped": _spike_skips(self.scaler) if enabled else None,
            "steps": int(self.scaler.snapshot()["steps"]) if enabled else None,
            "skipped_steps": list(self.record.skipped_steps),
            "num_skipped": self.record.num_skipped,
            "resumed_from": self.resumed_from,
            "attempt": self.attempt,
            "result": result,
        }
