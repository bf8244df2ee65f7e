"""What ``policy="predictive"`` measures on each rank: the largest finite gradient magnitude.

One extra read of the gradients per step: ``torch._foreach_norm(ord=inf)`` gives every tensor's
largest magnitude in one fused kernel per (device, dtype); tensors holding an inf or NaN are left
out, so the value is the largest magnitude among the tensors that stayed finite. Every
``sample_every`` steps it also counts the share of gradient elements that underflow in fp16 at the
current scale (zero or below fp16's smallest normal number, as ``dscale.stats`` counts them).

Everything stays in device tensors: no host sync. The values join the agreement vector
(``_agreement``) and are reduced with MAX with the overflow flag.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from dscale._unscale import copy_to

#: fp16's smallest normal number. Scaled grads below it lose precision (subnormal) or flush to 0.
FP16_MIN_NORMAL = 2.0**-14
#: Steps between underflow samples (the count reads every element, as the check pass does).
UNDERFLOW_SAMPLE_EVERY = 100
#: The underflow field when this step was not sampled; MAX keeps a real share over it.
NOT_SAMPLED = -1.0


class GradMeasure:
    """Accumulates one iteration's measurements from the check pass and the reduction hooks."""

    def __init__(self, sample_every: int = UNDERFLOW_SAMPLE_EVERY) -> None:
        self.sample_every = sample_every
        self.iteration = 0  # update() calls: the same on every rank, so ranks sample alike
        # device -> [largest unscaled magnitude, underflowing elements, elements]
        self._acc: dict[torch.device, torch.Tensor] = {}

    @property
    def sampling(self) -> bool:
        """Whether this iteration counts underflowing elements."""
        return self.iteration % self.sample_every == 0

    def add(self, grads: list[torch.Tensor], carried: torch.Tensor, scale: torch.Tensor) -> None:
        """Measure ``grads``, whose values carry the factor ``carried`` (the scale, or 1).

        ``scale`` is the loss scale of this step: an element underflows when its value at that
        scale is below fp16's smallest normal number.
        """
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for grad in grads:
            if grad.numel():
                by_device[grad.device].append(grad.detach())
        for device, tensors in by_device.items():
            acc = self._acc.get(device)
            if acc is None:
                acc = self._acc[device] = torch.zeros(3, dtype=torch.float32, device=device)
            here = carried.to(device, non_blocking=True).float().reshape(())
            norms = torch.stack(torch._foreach_norm(tensors, float("inf"), dtype=torch.float32))
            finite = torch.where(torch.isfinite(norms), norms, torch.zeros_like(norms)).max()
            acc[0] = torch.maximum(acc[0], finite / here)
            if self.sampling:
                limit = FP16_MIN_NORMAL * here / scale.to(device, non_blocking=True).float()
                small = torch.stack([(t.abs() < limit).sum() for t in tensors]).sum()
                acc[1] += small
                acc[2] += float(sum(t.numel() for t in tensors))

    def take(self, device: torch.device) -> torch.Tensor:
        """``[grad_max_abs, underflow share or NOT_SAMPLED]`` on ``device``; starts afresh."""
        out = torch.zeros(2, dtype=torch.float32, device=device)
        out[1].fill_(NOT_SAMPLED)  # a fill: `out[1] = x` copies a CPU scalar (a sync on CUDA)
        for acc in self._acc.values():
            _used_on_current_stream(acc)  # the hooks may have made it on a reduce stream
            acc = copy_to(acc, device)
            share = torch.where(acc[2] > 0, acc[1] / acc[2].clamp(min=1.0), out[1])
            out = torch.stack([torch.maximum(out[0], acc[0]), torch.maximum(out[1], share)])
        self._acc = {}
        return out

    def next_iteration(self) -> None:
        """Called by update(): the next step may be a sample."""
        self.iteration += 1
        self._acc = {}


def _used_on_current_stream(tensor: torch.Tensor) -> None:
    """Keep the allocator from reusing ``tensor`` before this stream's kernels have read it."""
    if tensor.is_cuda:
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
