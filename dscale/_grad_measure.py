"""What ``policy="predictive"`` measures on each rank: the largest gradient magnitude of the step.

The measurement reads the grad groups the check pass already builds, one
``torch._foreach_norm(ord=inf)`` per (device, dtype) group, and writes its result straight into
the agreement vector (``_agreement``), in scaled units (the grads as the backward left them). A
rank whose grads hold an inf or NaN writes ``OVERFLOW_MARK`` instead, which is what the rule
needs from an overflowed step (``_predictive``). Four ops for one group, whatever the number of
parameters.

Every ``sample_every`` steps it also writes ``1 +`` the share of gradient elements that underflow
in fp16 at the step's scale (below fp16's smallest normal number, as ``dscale.stats`` counts
them); 0 means "not sampled", so MAX over ranks keeps a real share and a fresh zero vector needs
no fill.

The reduction hooks of ``attach()`` measure the buckets and shards they reduce (unscaled by then)
into a small accumulator of their own (:func:`measure_reduced`), reset with their overflow flag.
"""

from __future__ import annotations

import math

import torch

from dscale._predictive import OVERFLOW_MARK
from dscale._unscale import GradGroups, copy_to

#: fp16's smallest normal number. Scaled grads below it lose precision (subnormal) or flush to 0.
FP16_MIN_NORMAL = 2.0**-14
#: Steps between underflow samples (the count reads every element, as the check pass does).
UNDERFLOW_SAMPLE_EVERY = 100


def _largest(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The largest magnitude over ``tensors`` (inf/NaN if any holds one), one 0-d fp32 tensor."""
    if 0 in map(torch.Tensor.numel, tensors):  # the inf-norm of an empty tensor is an error
        tensors = [t for t in tensors if t.numel()]
        if not tensors:
            return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(tensors, math.inf, dtype=torch.float32)
    return norms[0] if len(norms) == 1 else torch.stack(norms).amax()


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    # A per-tensor view; only on sampled steps (one in UNDERFLOW_SAMPLE_EVERY).
    return torch.cat([t.reshape(-1) for t in tensors])


class GradMeasure:
    """The sampling schedule and the measurement of the check pass's grad groups."""

    def __init__(self, sample_every: int = UNDERFLOW_SAMPLE_EVERY) -> None:
        self.sample_every = sample_every
        self.iteration = 0  # update() calls: the same on every rank, so ranks sample alike

    @property
    def sampling(self) -> bool:
        """Whether this iteration counts underflowing elements."""
        return self.iteration % self.sample_every == 0

    def write(
        self,
        vector: torch.Tensor,
        at: int,
        groups: GradGroups,
        hooks: torch.Tensor | None = None,
    ) -> None:
        """Measure ``groups`` (scaled grads) into ``vector[at]`` and ``vector[at + 1]``.

        ``hooks``: what the reduction hooks measured, ``[largest scaled magnitude, underflowing
        elements, elements]`` on ``vector``'s device. With neither, the fields stay 0 (nothing
        measured).
        """
        device = vector.device
        largest = [
            copy_to(_largest(tensors), device)
            for per_dtype in groups.values()
            for tensors in per_dtype.values()
        ]
        if hooks is not None:
            largest.append(hooks[0])
        if not largest:
            return
        value = largest[0] if len(largest) == 1 else torch.stack(largest).amax()
        torch.nan_to_num(value, nan=OVERFLOW_MARK, posinf=OVERFLOW_MARK, out=vector[at])
        if self.sampling:
            small = [
                copy_to((_flat(tensors).abs() < FP16_MIN_NORMAL).sum().float(), device)
                for per_dtype in groups.values()
                for tensors in per_dtype.values()
            ]
            elements = float(sum(t.numel() for d in groups.values() for g in d.values() for t in g))
            if hooks is not None:
                small.append(hooks[1])
            total = torch.stack(small).sum() if small else torch.zeros((), device=device)
            count = hooks[2] + elements if hooks is not None else torch.tensor(elements)
            share = total / copy_to(torch.as_tensor(count, dtype=torch.float32), device).clamp(
                min=1.0
            )
            vector[at + 1].copy_(share + 1.0)

    def next_iteration(self) -> None:
        """Called by update(): the next step may be a sample."""
        self.iteration += 1


def mark_overflow(vector: torch.Tensor, at: int, flag: torch.Tensor) -> None:
    """Another source's overflow flag joins the vector's: its measurement reads as overflowed."""
    torch.maximum(vector[at], (flag > 0).float() * OVERFLOW_MARK, out=vector[at])


def measure_reduced(
    acc: torch.Tensor | None, tensors: list[torch.Tensor], scale: torch.Tensor, sampling: bool
) -> torch.Tensor:
    """Add reduced, unscaled grads to a hook's ``[scaled max, small, elements]`` accumulator."""
    device = tensors[0].device
    if acc is None:
        acc = torch.zeros(3, dtype=torch.float32, device=device)
    scale = scale.to(device).float().reshape(())
    scaled = torch.nan_to_num(
        _largest(tensors).to(device) * scale, nan=OVERFLOW_MARK, posinf=OVERFLOW_MARK
    )
    torch.maximum(acc[0], scaled, out=acc[0])
    if sampling:
        flat = _flat(tensors)
        acc[1] += (flat.abs() * scale < FP16_MIN_NORMAL).sum()
        acc[2] += float(flat.numel())
    return acc
