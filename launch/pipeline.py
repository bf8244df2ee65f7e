"""Pipeline parallel: the demo GPT split into stages, and one rank's stage with its schedule.

Each rank of the ``pp`` mesh dim runs one stage: the first holds the embeddings, the last the
final norm and the head, and the blocks are split evenly in order (torchtitan's split). A stage
keeps the full model's parameter names (``layers.3.ln1.weight``), so its checkpoint shards fit
together as the unsplit model's. :class:`Pipeline` runs ``torch.distributed.pipelining``'s
GPipe or 1F1B schedule with ``loss_fn=scaler.pipeline_loss(loss_fn)``: the scaler scales each
microbatch's loss, ignores torch's shape-inference call, and lets the stages without the loss
step without a ``scale()`` of their own (docs/scaler.md, "Pipeline parallel").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from dscale import GradScaler
from dscale.models import GPT

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}

#: ``split(model, stage_index, num_stages)``: the part of ``model`` that stage runs.
Split = Callable[[nn.Module, int, int], nn.Module]


class GPTStage(nn.Module):
    """Blocks ``first`` .. ``last - 1`` of a GPT, with its embeddings on the first stage and its
    norm and head on the last. Takes tokens (first stage) or activations; returns activations
    or logits (last stage)."""

    def __init__(self, model: GPT, first: int, last: int, *, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.embed = model.embed if is_first else None
        self.pos = model.pos if is_first else None
        # A ModuleDict keyed by the block's index in the whole model: the same names as GPT's.
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(first, last)})
        self.norm = model.norm if is_last else None
        self.head = model.head if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if self.embed is not None and self.pos is not None:
            x = self.embed(x) + self.pos(torch.arange(t, device=x.device))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        for layer in self.layers.values():
            x = layer(x, mask)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


def split_gpt(model: nn.Module, stage_index: int, num_stages: int) -> nn.Module:
    """Stage ``stage_index`` of ``num_stages`` of the demo GPT (its blocks divide evenly)."""
    if not isinstance(model, GPT):
        raise ValueError(
            f"parallel=pp has a stage split for the demo GPT only, not for "
            f"{type(model).__name__}: pass split=fn to ctx.pipeline, where fn(model, "
            "stage_index, num_stages) returns the module that stage runs"
        )
    per_stage = len(model.layers) // num_stages
    first = stage_index * per_stage
    return GPTStage(
        model,
        first,
        first + per_stage,
        is_first=stage_index == 0,
        is_last=stage_index == num_stages - 1,
    )


class Pipeline:
    """This rank's stage and the schedule that runs a batch through all stages.

    ``module`` is the stage's part of the model: give it to the optimizer, ``ctx.checkpoints``,
    ``ctx.metrics`` and ``ctx.faults``. :meth:`step` replaces the forward, the loss and
    ``scaler.scale(loss).backward()``; ``scaler.step(optimizer)`` and ``scaler.update()`` follow
    on every stage as in any loop, and agree across stages in the scaler's one collective.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        mesh: DeviceMesh,
        schedule: str,
        microbatches: int,
        scaler: GradScaler,
        device: torch.device,
        split: Split | None = None,
    ) -> None:
        pp = mesh["pp"]
        self.stage_index, self.num_stages = pp.get_local_rank(), pp.size()
        self.is_first = self.stage_index == 0
        self.is_last = self.stage_index == self.num_stages - 1
        self.module = (split or split_gpt)(model, self.stage_index, self.num_stages).to(device)
        self._group = pp.get_group()
        self._last_rank = dist.get_global_rank(self._group, self.num_stages - 1)
        self._loss_fn, self._device = loss_fn, device
        self._microbatches = microbatches
        self._losses: list[torch.Tensor] = []
        stage = PipelineStage(
            self.module, self.stage_index, self.num_stages, device, group=self._group
        )
        self.schedule = SCHEDULES[schedule](
            stage, microbatches, loss_fn=scaler.pipeline_loss(self._noted_loss)
        )

    def _noted_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss for one microbatch, noted for :meth:`step`'s mean (unscaled)."""
        loss = self._loss_fn(output, target)
        self._losses.append(loss.detach())
        return loss

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch on every stage; the batch's mean loss on every rank.

        Every stage passes the whole batch (only the first reads ``inputs``, only the last
        ``targets``). The mean is over the microbatches' losses, sent from the last stage (one
        float, one broadcast over the ``pp`` group).
        """
        self._losses.clear()
        if self.is_first and self.is_last:  # one stage (parallel.pp=1): it reads both
            self.schedule.step(inputs, target=targets)
        elif self.is_first:
            self.schedule.step(inputs)
        elif self.is_last:
            self.schedule.step(target=targets)
        else:
            self.schedule.step()
        if self.is_last:
            # torch runs loss_fn once more on a schedule's first step to learn the shapes; the
            # step's own microbatches are the last calls.
            loss = torch.stack(self._losses[-self._microbatches :]).float().mean()
        else:
            loss = torch.zeros((), device=self._device)
        dist.broadcast(loss, src=self._last_rank, group=self._group)
        return loss
