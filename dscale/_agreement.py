"""The scaler's one collective: every rank learns whether any rank saw an inf or NaN.

All cross-rank agreement goes through :func:`all_reduce_flag`, so tests can count it by patching
this single function. What travels is a small float32 vector reduced with MAX, one field per
:data:`FIELDS` entry: the overflow flag, and the scale and its negation (so MAX gives the largest
and, negated back, the smallest scale over the ranks: the rank-agreement check costs no extra
collective and, being part of the step, cannot be called on some ranks only). A new field (for
example a max grad magnitude) is one more entry whose MAX over ranks is what it needs.

``policy="predictive"`` appends two fields (``_grad_measure``): the largest finite gradient
magnitude and the sampled underflow share; MAX gives the largest over the ranks, so every rank
sets the same next scale. A dynamic scaler sends the first three only, as before.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from dscale._unscale import copy_to

#: The agreement vector's fields, in order.
FIELDS = ("overflow", "scale", "neg_scale", "grad_max_abs", "underflow")
OVERFLOW, SCALE, NEG_SCALE, GRAD_MAX_ABS, UNDERFLOW = range(len(FIELDS))


class ScaleRange(NamedTuple):
    """Smallest and largest scale over the ranks of one agreement (one-element tensors)."""

    low: torch.Tensor
    high: torch.Tensor


def agreement_vector(
    flag: torch.Tensor, scale: torch.Tensor, measured: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's vector: ``flag``, ``scale`` (and ``measured``), on one device, FIELDS order.

    ``measured`` is ``[grad_max_abs, underflow]`` (predictive policy); without it the vector
    stops after ``neg_scale``.
    """
    scale = scale.reshape(()).float()
    vector = torch.stack([flag.reshape(()).float(), scale, -scale])
    return vector if measured is None else torch.cat([vector, measured.float().reshape(2)])


def blank_vector(
    scale: torch.Tensor,
    host_scale: float | None,
    device: torch.device,
    measured: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's vector with the overflow field 0, for the check to write its flag into.

    ``host_scale`` is the scale's value when the host knows it: on the CPU the vector is then
    made from Python numbers in one call instead of a few tensor ops.
    """
    if host_scale is not None and device.type == "cpu":
        vector = _cpu_template(host_scale).clone()
        return vector if measured is None else torch.cat([vector, measured.float().reshape(2)])
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return agreement_vector(zero, copy_to(scale, device), measured)


@functools.lru_cache(maxsize=4)
def _cpu_template(host_scale: float) -> torch.Tensor:
    """``[0, scale, -scale]`` for a scale value (it changes rarely): a copy is one cheap op."""
    return torch.tensor([0.0, host_scale, -host_scale], dtype=torch.float32)


def scale_range(agreed: torch.Tensor) -> ScaleRange:
    """Min and max of the scale over the ranks, read from an agreed vector (no host sync)."""
    return ScaleRange(-agreed[NEG_SCALE], agreed[SCALE])


def all_reduce_flag(values: torch.Tensor, group: Any) -> Any:
    """Start a MAX all-reduce of the agreement vector ``values`` in place; return its work handle.

    MAX, not SUM: one rank's inf must skip the step on every rank, and the flag stays 0 or 1-ish
    whatever the world size. The call is asynchronous; on NCCL ``work.wait()`` only makes the
    current CUDA stream wait, so the host never blocks here.
    """
    return dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group, async_op=True)
