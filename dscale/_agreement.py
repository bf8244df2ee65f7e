"""The scaler's one collective: every rank learns whether any rank saw an inf or NaN.

All cross-rank agreement goes through :func:`all_reduce_flag`, so tests can count it by patching
this single function. What travels is a small float32 vector reduced with MAX, one field per
:data:`FIELDS` entry: the overflow flag, and the scale and its negation (so MAX gives the largest
and, negated back, the smallest scale over the ranks: the rank-agreement check costs no extra
collective and, being part of the step, cannot be called on some ranks only). A new field (for
example a max grad magnitude) is one more entry whose MAX over ranks is what it needs.

``policy="predictive"`` appends two fields (``_grad_measure``): the largest finite gradient
magnitude and the sampled underflow share; MAX gives the largest over the ranks, so every rank
sets the same next scale, and sends all five every step.

A dynamic scaler sends the scale fields only on every :data:`RANGE_EVERY`-th iteration (the first
included) and the flag alone in between: on gloo a one-element all-reduce takes a third or less of
the time a three-element one does (``tests/scaler/measure_flag_allreduce.py``: about 0.5 ms
against 1.5-2 ms on 2 ranks of a 2-core machine), and the scale range is for a check that runs
every hundred steps. The schedule counts ``update()`` calls, which every rank makes alike, so
every rank sends a vector of the same length.
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


#: A dynamic scaler's vector carries the scale fields on iterations 0, RANGE_EVERY, 2 x ...
RANGE_EVERY = 16


def carries_range(iteration: int) -> bool:
    """Whether a dynamic scaler's vector carries the scale fields at ``iteration`` (0-based)."""
    return iteration % RANGE_EVERY == 0


class ScaleRange(NamedTuple):
    """Smallest and largest scale over the ranks of one agreement (one-element tensors)."""

    low: torch.Tensor
    high: torch.Tensor


def agreement_vector(
    flag: torch.Tensor,
    scale: torch.Tensor,
    measured: torch.Tensor | None = None,
    *,
    with_range: bool = True,
) -> torch.Tensor:
    """This rank's vector: ``flag``, ``scale`` (and ``measured``), on one device, FIELDS order.

    ``measured`` is ``[grad_max_abs, underflow]`` (predictive policy); without it the vector
    stops after ``neg_scale``, and without ``with_range`` it is the flag alone.
    """
    if not with_range and measured is None:
        return flag.reshape(1).float()
    scale = scale.reshape(()).float()
    vector = torch.stack([flag.reshape(()).float(), scale, -scale])
    return vector if measured is None else torch.cat([vector, measured.float().reshape(2)])


def blank_vector(
    scale: torch.Tensor,
    host_scale: float | None,
    device: torch.device,
    measured: torch.Tensor | None = None,
    *,
    with_range: bool = True,
) -> torch.Tensor:
    """This rank's vector with the overflow field 0, for the check to write its flag into.

    ``host_scale`` is the scale's value when the host knows it: on the CPU the vector is then
    made from Python numbers in one call instead of a few tensor ops. Without ``with_range``
    (and ``measured``) it is the flag alone.
    """
    if not with_range and measured is None:
        return torch.zeros(1, dtype=torch.float32, device=device)
    if host_scale is not None and device.type == "cpu":
        vector = _cpu_template(host_scale).clone()
        return vector if measured is None else torch.cat([vector, measured.float().reshape(2)])
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return agreement_vector(zero, copy_to(scale, device), measured)


@functools.lru_cache(maxsize=4)
def _cpu_template(host_scale: float) -> torch.Tensor:
    """``[0, scale, -scale]`` for a scale value (it changes rarely): a copy is one cheap op."""
    return torch.tensor([0.0, host_scale, -host_scale], dtype=torch.float32)


def scale_range(agreed: torch.Tensor) -> ScaleRange | None:
    """Min and max of the scale over the ranks, read from an agreed vector (no host sync).

    None when the vector is the flag alone (an iteration that did not carry the range).
    """
    if agreed.numel() <= NEG_SCALE:
        return None
    return ScaleRange(-agreed[NEG_SCALE], agreed[SCALE])


def all_reduce_flag(values: torch.Tensor, group: Any) -> Any:
    """Start a MAX all-reduce of the agreement vector ``values`` in place; return its work handle.

    MAX, not SUM: one rank's inf must skip the step on every rank, and the flag stays 0 or 1-ish
    whatever the world size. The call is asynchronous; on NCCL ``work.wait()`` only makes the
    current CUDA stream wait, so the host never blocks here.
    """
    return dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group, async_op=True)
