"""The scaler's one collective: every rank learns whether any rank saw an inf or NaN.

All cross-rank agreement goes through :func:`all_reduce_flag`, so tests can count it by patching
this single function. What travels is a small float32 vector reduced with MAX, one field per
:data:`FIELDS` entry: the overflow flag, and the scale and its negation (so MAX gives the largest
and, negated back, the smallest scale over the ranks: the rank-agreement check costs no extra
collective and, being part of the step, cannot be called on some ranks only). A new field (for
example a max grad magnitude) is one more entry whose MAX over ranks is what it needs.

``policy="predictive"`` appends two fields (``_grad_measure``): the largest gradient magnitude
(scaled; ``OVERFLOW_MARK`` from a rank that overflowed) and the sampled underflow share plus one
(0: not sampled); MAX gives the largest over the ranks, so every rank sets the same next scale.
They follow the flag and the scale fields (:func:`measured_at`); the spike gate's fields come after
them.

Both policies send the scale fields only on every :data:`RANGE_EVERY`-th iteration (the first
included) and the flag (and measurement) alone in between: on gloo a one-element all-reduce takes
a third or less of the time a three-element one does (``tests/scaler/measure_flag_allreduce.py``:
about 0.5 ms against 1.5-2 ms on 2 ranks of a 2-core machine), and the scale range is for a check
that runs every hundred steps. The schedule counts ``update()`` calls, which every rank makes
alike, so every rank sends a vector of the same length.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from dscale._unscale import copy_to

#: The agreement vector's fields, in order; the scale fields only on range iterations, the
#: measurement with policy="predictive" only (then the spike gate's, ``_spike_gate``).
FIELDS = ("overflow", "scale", "neg_scale", "grad_max_abs", "underflow")
OVERFLOW, SCALE, NEG_SCALE = range(3)


def measured_at(with_range: bool) -> int:
    """Index of policy="predictive"'s first field (grad_max_abs; underflow follows)."""
    return 3 if with_range else 1


#: The vector carries the scale fields on iterations 0, RANGE_EVERY, 2 x ...
RANGE_EVERY = 16


def carries_range(iteration: int) -> bool:
    """Whether the vector carries the scale fields at ``iteration`` (0-based)."""
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

    ``measured`` is ``[grad_max_abs, underflow]`` (predictive policy); without ``with_range``
    the scale fields are left out.
    """
    parts = [flag.reshape(1).float()]
    if with_range:
        scale = scale.reshape(1).float()
        parts += [scale, -scale]
    if measured is not None:
        parts.append(measured.float().reshape(2))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def blank_vector(
    scale: torch.Tensor,
    host_scale: float | None,
    device: torch.device,
    *,
    measured: bool = False,
    with_range: bool = True,
) -> torch.Tensor:
    """This rank's vector with the flag (and measurement) fields 0, for the check to write into.

    ``host_scale`` is the scale's value when the host knows it: on the CPU the vector is then
    made from Python numbers in one call instead of a few tensor ops.
    """
    extra = 2 if measured else 0
    if not with_range:
        return torch.zeros(1 + extra, dtype=torch.float32, device=device)
    if host_scale is not None and device.type == "cpu":
        return _cpu_template(host_scale, extra).clone()
    # [0, 1, -1, 0...] * scale: the whole vector in one op (the scale is finite, never inf).
    return _pattern(device, extra) * copy_to(scale, device).reshape(()).float()


@functools.lru_cache(maxsize=8)
def _pattern(device: torch.device, extra: int) -> torch.Tensor:
    return torch.tensor([0.0, 1.0, -1.0] + [0.0] * extra, dtype=torch.float32).to(device)


@functools.lru_cache(maxsize=4)
def _cpu_template(host_scale: float, extra: int) -> torch.Tensor:
    """``[0, scale, -scale]`` (and ``extra`` zeros) for a scale value (it changes rarely)."""
    return torch.tensor([0.0, host_scale, -host_scale] + [0.0] * extra, dtype=torch.float32)


def scale_range(agreed: torch.Tensor) -> ScaleRange:
    """Min and max of the scale over the ranks, from a vector that carried them (no host sync)."""
    return ScaleRange(-agreed[NEG_SCALE], agreed[SCALE])


def append_field(vector: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``vector`` with ``part`` appended as float32, NaN sent as +inf (so MAX cannot drop it)."""
    part = part.to(vector.device, torch.float32).reshape(-1)
    return torch.cat(
        [vector, torch.nan_to_num(part, nan=math.inf, posinf=math.inf, neginf=-math.inf)]
    )


class AgreementField(Protocol):
    """A feature's values riding the vector (``GradScaler.add_agreement_field``).

    ``append_to`` returns ``vector`` with this rank's values for ``optimizer``'s step appended
    with :func:`append_field` (or ``vector`` itself), the same length on every rank; the field
    keeps the returned tensor
    and its offset, and reads the agreed values there once the step is decided.
    """

    def append_to(self, vector: torch.Tensor, optimizer: Any) -> torch.Tensor: ...


def all_reduce_flag(values: torch.Tensor, group: Any) -> Any:
    """Start a MAX all-reduce of the agreement vector ``values`` in place; return its work handle.

    MAX, not SUM: one rank's inf must skip the step on every rank, and the flag stays 0 or 1-ish
    whatever the world size. No field may hold a NaN: gloo's and NCCL's MAX drop a NaN sent by a
    non-zero rank (5.0 wins over NaN from rank 1; MS-AMP PR #58). Each field is NaN-free where it
    is made, so the seam adds no op: the flag is 0 or 1 (the check's kernel, flags folded as
    ``> 0``), the scale finite, predictive's and the spike gate's fields ``nan_to_num``-ed, and
    registered fields appended through :func:`append_field`. The call is asynchronous; on NCCL
    ``work.wait()`` only makes the current CUDA stream wait, so the host never blocks here.
    """
    return dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group, async_op=True)
