"""Per-rank fused inf/NaN check and unscale, grouped by (device, dtype).

Each rank looks only at the gradients it holds: for a DTensor (FSDP2, tensor parallel) that is the
local shard, whatever its placement, because unscaling is linear and an inf in any local piece makes
the global value non-finite too. Agreement across ranks is the job of ``agreement``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from operator import attrgetter
from typing import cast

import torch

from dscale.scaler._program.scale_rule import HostState, f32

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch builds without distributed
    DTensor = None  # type: ignore[assignment,misc]

GradGroups = dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]
_IS_SPARSE = attrgetter("is_sparse")


def local_tensor(grad: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of ``grad`` (its local shard for a DTensor)."""
    if DTensor is not None and isinstance(grad, DTensor):
        return grad._local_tensor
    return grad


def optimizer_grads(
    optimizer: torch.optim.Optimizer, skip: set[int] | None = None
) -> list[torch.Tensor]:
    """Rank-local tensors to check for ``optimizer``: DTensors unwrapped, sparse grads' values.

    ``skip`` holds ids of parameters whose grads were already handled (the DDP hook).
    """
    if torch.compiler.is_compiling():  # traced once: plain loops (no walrus, no map())
        return _traced_grads(optimizer, skip)
    if not skip:  # the common case, in one pass at C speed per element (no call per grad)
        grads = [
            grad
            for group in optimizer.param_groups
            for param in group["params"]
            if (grad := param.grad) is not None
        ]
        # map() with C callables: about 0.1 us a grad, half of a generator's per-grad test.
        if set(map(type, grads)) <= {torch.Tensor} and not any(map(_IS_SPARSE, grads)):
            return grads
    out: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None or (skip is not None and id(param) in skip):
                continue
            grad = local_tensor(grad)
            if grad.is_sparse:
                # Duplicate indices add up on coalesce and may overflow then, so check coalesced.
                if grad.dtype is torch.float16:
                    grad = grad.coalesce()
                    if param.grad.is_sparse:
                        param.grad = grad
                grad = grad._values()
            out.append(grad)
    return out


def _traced_grads(optimizer: torch.optim.Optimizer, skip: set[int] | None) -> list[torch.Tensor]:
    """:func:`optimizer_grads` in the form dynamo traces (its loop runs at trace time only)."""
    out: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None or (skip is not None and id(param) in skip):
                continue
            if grad.is_sparse:
                raise ValueError(
                    "torch.compile around scaler.step(): a sparse grad cannot be checked in the "
                    "compiled region; step this optimizer outside torch.compile"
                )
            out.append(local_tensor(grad))
    return out


def group_by_device_and_dtype(grads: Sequence[torch.Tensor]) -> GradGroups:
    """Split ``grads`` into lists that one fused kernel call can take (torch's own grouping)."""
    groups: GradGroups = defaultdict(dict)
    if not grads:
        return groups
    grouped = torch._C._group_tensors_by_device_and_dtype([list(grads)], False)
    for (device, dtype), (tensors, _) in grouped.items():
        groups[device][dtype] = cast(list[torch.Tensor], tensors[0])  # no None went in
    return groups


def check_and_unscale_(
    groups: GradGroups,
    inv_scale: torch.Tensor,
    found: torch.Tensor,
    checked: torch.Tensor | None = None,
) -> None:
    """Multiply every grad by ``inv_scale``; make ``found`` (one element, zeroed) > 0 on inf/NaN.

    One ``_amp_foreach_non_finite_check_and_unscale_`` call per (device, dtype): a single
    read-and-write pass in fp32 math, fp16 grads included. Grads on ``found``'s device write it
    directly; another device's flag is added to it without a host sync (CPU->GPU copies are
    non-blocking, a GPU->CPU copy only happens when the backend can only reduce on the CPU).

    ``checked``: only where ``inv_scale`` is 1 (the grads stay scaled: a fused optimizer unscales
    them itself), a 0-d tensor on ``found``'s device that is inf or NaN exactly when a grad in
    ``groups`` holds one (``GradMeasure.write``'s CPU measurement). The same kernel then checks
    that one value instead of every grad: the pass would multiply each grad by 1, which leaves it
    as it is, so only the flag is needed, and on the CPU reading and rewriting every grad cost as
    much as the measurement itself.
    """
    if torch.compiler.is_compiling():
        _traced_check_and_unscale_(groups, inv_scale, found)
        return
    if checked is not None:
        unit = copy_to(inv_scale, found.device)
        torch._amp_foreach_non_finite_check_and_unscale_([checked], found, unit)
        return
    for device, per_dtype in groups.items():
        here = found if device == found.device else torch.zeros((), device=device)
        scale_here = copy_to(inv_scale, device)  # a CPU kernel reads it at once (CPU offload)
        for grads in per_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, here, scale_here)
        if here is not found:  # MAX: the flag stays 0 or 1 (fused kernels test == 1)
            torch.maximum(found, copy_to(here, found.device), out=found)


def _traced_check_and_unscale_(
    groups: GradGroups, inv_scale: torch.Tensor, found: torch.Tensor
) -> None:
    """:func:`check_and_unscale_` as plain pointwise ops and reductions, which Inductor fuses
    (it does not lower torch's amp kernel): the same flag (1 where a grad holds an inf or NaN)
    and the same grads (each times ``inv_scale`` in fp32, rounded once to its dtype)."""
    flags = []
    for device, per_dtype in groups.items():
        scale_here = copy_to(inv_scale, device)
        for grads in per_dtype.values():
            for grad in grads:
                flags.append(copy_to(grad.isfinite().logical_not().any(), found.device))
                grad.copy_(grad.float() * scale_here)
    if flags:
        any_bad = flags[0] if len(flags) == 1 else torch.stack(flags).any()
        found.copy_(torch.maximum(found, any_bad.float()))


def norms(tensors: list[torch.Tensor], ord: float) -> tuple[torch.Tensor, ...]:
    """``torch._foreach_norm`` accumulated in fp32 (an fp16 norm overflows near 65504); fp64
    tensors keep their fp64 norm, since torch refuses to narrow them to an fp32 accumulator.

    One multi-tensor kernel for a list of one dtype (fp64 included); a list mixing fp64 with
    other dtypes takes a call per tensor.
    """
    try:
        return tuple(torch._foreach_norm(tensors, ord, dtype=torch.float32))
    except RuntimeError:
        wide = [t.dtype == torch.float64 for t in tensors]
        if all(wide):
            return tuple(torch._foreach_norm(tensors, ord))
        if not any(wide):
            raise
        return tuple(norms([t], ord)[0] for t in tensors)


def copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``, safe to read on the host as soon as this returns.

    Host-to-device and device-to-device copies are non-blocking (stream-ordered). A device-to-host
    copy is blocking: a non_blocking one returns before the data lands, and the host (gloo, a
    CPU-side step counter, a CPU-offloaded grad) would read memory not yet written.
    """
    if tensor.device == device:
        return tensor
    to_host = tensor.device.type != "cpu" and device.type == "cpu"
    return tensor.to(device, non_blocking=not to_host)


class NoGrad:
    """``torch.no_grad()`` at a third of its cost (1.3 us there): the check runs every step."""

    __slots__ = ("enabled",)

    def __enter__(self) -> None:
        self.enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch._C._set_grad_enabled(self.enabled)


class UnscaleFactors:
    """1/scale and 1.0 as tensors, made once per scale value and device."""

    def __init__(self) -> None:
        self._inverse: tuple[float, torch.Tensor] | None = None
        self._one: torch.Tensor | None = None

    def inverse(self, scale: torch.Tensor, host: HostState | None) -> torch.Tensor:
        """1/scale, made once per scale value while the host knows the scale."""
        if host is None:  # the reciprocal in fp64, as torch does: fp32 division can be imprecise
            return scale.double().reciprocal().float()
        cached = self._inverse
        if cached is None or cached[0] != host.scale or cached[1].device != scale.device:
            # The same fp64 reciprocal rounded once to fp32 (inf for a scale that underflowed).
            inverse = f32(1.0 / host.scale) if host.scale else math.inf
            cached = (host.scale, torch.full((), inverse, device=scale.device))
            self._inverse = cached
        return cached[1]

    def one(self, scale: torch.Tensor) -> torch.Tensor:
        """A 1.0 to check without unscaling (fused optimizers unscale in their own kernel)."""
        if self._one is None or self._one.device != scale.device:
            self._one = torch.ones_like(scale)
        return self._one
