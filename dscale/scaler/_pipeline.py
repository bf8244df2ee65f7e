"""Pipeline schedules (``torch.distributed.pipelining``): the loss their ``loss_fn`` computes.

A pipeline schedule calls its ``loss_fn`` on the rank that holds the last stage, once per
microbatch, and runs the backward from what it returns: that is where the scale must be applied
(``loss_fn=scaler.pipeline_loss(loss_fn)``). Three things make it unlike a plain loop:

- **Shape inference.** On a schedule's first step (and on the first step of a schedule built
  again, as after a restart) torch 2.13's ``PipelineStage`` runs the stage on uninitialised
  tensors to infer the shapes of the gradients, and calls ``loss_fn`` on that output
  (``_backward_metadata_inference``). That value is garbage (inf, 1e22 and 1e31 were seen); a
  spike gate that records it fires on it, or takes it into its window. The signal used here:
  the call comes from a method of a pipeline *stage*, where the schedule's real losses come from
  a method of the *schedule* (``_compute_loss``). :func:`call_site` walks the caller's frames to
  the first one whose ``self`` is either; nothing is walked unless ``torch.distributed.pipelining``
  is imported.
- **Evaluation.** ``schedule.eval()`` calls ``loss_fn`` too; its losses belong to no training
  step, so they are neither scaled nor recorded.
- **Stages without the loss.** Only the last stage's rank sees a loss. The others call no
  ``scale()``; a scaler made pipelined by :meth:`GradScaler.pipeline_loss` places its scale at
  their first ``step()`` instead of refusing it, and the spike gate's loss is the mean over the
  ranks that hold one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch

#: How the microbatch losses of one step make the step's loss: "mean" for a ``loss_fn`` that
#: averages within its microbatch (torch's default ``scale_grads=True`` divides the grads by the
#: number of microbatches to match), "sum" for one that returns each microbatch's share.
MicrobatchReduction = Literal["mean", "sum"]
REDUCTIONS = ("mean", "sum")

#: Frames walked up from the loss function (torch's own path is 3 to 5 deep; a user's wrappers
#: around the loss add theirs).
_MAX_DEPTH = 24

INFERENCE, EVALUATION, TRAINING = "inference", "evaluation", "training"


def call_site() -> str:
    """Where the loss function is being called from: INFERENCE, EVALUATION or TRAINING.

    INFERENCE: a pipeline stage's shape inference (its output is garbage); EVALUATION: a
    schedule's ``eval()``; TRAINING otherwise, a call from no pipeline included.
    """
    stage_module = sys.modules.get("torch.distributed.pipelining.stage")
    if stage_module is None:  # no pipelining imported: no frame to look for
        return TRAINING
    stage_type = getattr(stage_module, "_PipelineStageBase", None)
    schedules = sys.modules.get("torch.distributed.pipelining.schedules")
    schedule_type = getattr(schedules, "_PipelineSchedule", None)
    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            break
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            owner = frame.f_locals.get("self")
            if stage_type is not None and isinstance(owner, stage_type):
                return INFERENCE
            if schedule_type is not None and isinstance(owner, schedule_type):
                return TRAINING if getattr(owner, "_has_backward", True) else EVALUATION
        frame = frame.f_back  # type: ignore[assignment]
    return TRAINING


def check_reduction(reduction: Any) -> MicrobatchReduction:
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"microbatch_reduction must be one of {REDUCTIONS}, got {reduction!r}: 'mean' when "
            "loss_fn averages over its microbatch and the schedule divides the grads by the "
            "number of microbatches (scale_grads=True, torch's default), 'sum' when loss_fn "
            "returns each microbatch's share of the step's loss (scale_grads=False)"
        )
    return reduction  # type: ignore[no-any-return]


class Scaler(Protocol):
    """What :class:`PipelineLoss` reads of the scaler."""

    def _scale_microbatch_loss(self, loss: torch.Tensor) -> torch.Tensor: ...


class PipelineLoss:
    """A schedule's ``loss_fn``: the user's loss, scaled and recorded once per real microbatch.

    Made by :meth:`dscale.GradScaler.pipeline_loss`; see the module docstring.
    """

    def __init__(self, scaler: Scaler, loss_fn: Callable[..., torch.Tensor]) -> None:
        if not callable(loss_fn):
            raise ValueError(
                f"pipeline_loss() takes the loss function the schedule would call, "
                f"loss_fn(output, target) -> Tensor; got {type(loss_fn).__name__}"
            )
        self.scaler = scaler
        self.loss_fn = loss_fn

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = self.loss_fn(*args, **kwargs)
        if call_site() != TRAINING:  # shape inference or eval(): not a step's loss
            return loss
        return self.scaler._scale_microbatch_loss(loss)

    def __repr__(self) -> str:
        return f"PipelineLoss({self.loss_fn!r})"
