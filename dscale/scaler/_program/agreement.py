"""The scaler's one collective: every rank learns whether any rank saw an inf or NaN.

All cross-rank agreement goes through :func:`all_reduce_flag`, so tests can count it by patching
this single function. What travels is a small float32 vector reduced with MAX, whose fields
:class:`Layout` declares, in order: the overflow flag; the scale and its negation (so MAX gives
the largest and, negated back, the smallest scale over the ranks: the rank-agreement check costs
no extra collective and, being part of the step, cannot be called on some ranks only);
``policy="predictive"``'s measurement (``grad_measure``: the largest gradient magnitude, scaled,
``OVERFLOW_MARK`` from a rank that overflowed, and the sampled underflow share plus one); the
fields that features register (``GradScaler.add_agreement_field``: dscale.fp8's amaxes); the
spike gate's slots (``spike_gate``). Each is a value whose MAX over the ranks is what the
feature needs, so every rank decides alike.

Both policies send the scale fields only on every :data:`RANGE_EVERY`-th iteration (the first
included) and the flag (and measurement) alone in between: on gloo a one-element all-reduce takes
a third or less of the time a three-element one does (``tests/scaler/measure_flag_allreduce.py``:
about 0.5 ms against 1.5-2 ms on 2 ranks of a 2-core machine), and the scale range is for a check
that runs every hundred steps. The schedule counts ``update()`` calls, which every rank makes
alike, so every rank sends a vector of the same length.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from dscale.scaler._program.unscale import copy_to

#: Fixed indices of the leading fields (:class:`Layout` places the rest): the flag, then on
#: range iterations the scale and its negation.
OVERFLOW, SCALE, NEG_SCALE = range(3)
#: The Layout key of the spike gate's slots (``spike_gate``), always the last part.
SPIKE = "spike"


#: The vector carries the scale fields on iterations 0, RANGE_EVERY, 2 x ...
RANGE_EVERY = 16


def carries_range(iteration: int) -> bool:
    """Whether the vector carries the scale fields at ``iteration`` (0-based)."""
    return iteration % RANGE_EVERY == 0


class ScaleRange(NamedTuple):
    """Smallest and largest scale over the ranks of one agreement (one-element tensors)."""

    low: torch.Tensor
    high: torch.Tensor


class AgreementField(Protocol):
    """A feature's values riding the vector (``GradScaler.add_agreement_field``; dscale.fp8).

    ``values`` gives this rank's values for ``optimizer``'s step (any float dtype, the same
    length on every rank; NaN is sent as +inf), or None to send nothing this step, on every rank
    alike. ``agreed`` is then handed this field's slots in the vector that is all-reduced in
    place: they hold the agreed values once the step has read its flag (a step callback).
    A field may also have ``refresh()`` (see :meth:`Layout.refresh`): its values again, when
    ``unscale_()`` deferred the collective and the grads may have changed since; and
    ``verify()`` (see :func:`verify_fields`): called once the collective completed, before the
    step obeys it, in a step where it sent values; it may raise (on every rank alike).
    """

    def values(self, optimizer: Any) -> torch.Tensor | None: ...

    def agreed(self, slots: torch.Tensor) -> None: ...


class Layout:
    """Where each field sits in one check's vector, declared as the check builds it.

    The leading fields are slots that the check's kernels write in place (no op to add them):
    the flag, the scale and its negation on range iterations, predictive's measurement. The
    parts that features register follow in one ``cat``: each :class:`AgreementField`, then
    the spike gate's slots (:data:`SPIKE`). A reader asks the layout for a field's slots
    instead of counting offsets, so a new field touches its own module only.
    """

    def __init__(self, *, with_range: bool, measured: bool) -> None:
        self.with_range = with_range
        self.measured = measured
        self.slots: dict[Any, slice] = {}
        self.width = 0
        self._add("overflow", 1)
        if with_range:
            self._add("scale", 2)  # the scale, then its negation
        if measured:
            self._add("measured", 2)  # grad_max_abs, underflow (``grad_measure``)

    @staticmethod
    @functools.lru_cache(maxsize=4)
    def leading(with_range: bool, measured: bool) -> Layout:
        """The leading fields' layout, made once (shared: :meth:`append` copies it to extend)."""
        return Layout(with_range=with_range, measured=measured)

    def _add(self, key: Any, width: int) -> None:
        self.slots[key] = slice(self.width, self.width + width)
        self.width += width

    def start(self, key: Any) -> int:
        """The index of ``key``'s first slot."""
        return int(self.slots[key].start)

    def view(self, vector: torch.Tensor, key: Any) -> torch.Tensor:
        """``key``'s slots in ``vector`` (a view: it follows an in-place all-reduce)."""
        return vector[self.slots[key]]

    def blank(
        self, scale: torch.Tensor, host_scale: float | None, device: torch.device
    ) -> torch.Tensor:
        """The leading fields with the flag (and measurement) 0, for the check to write into.

        ``host_scale`` is the scale's value when the host knows it: on the CPU the vector is then
        made from Python numbers in one call instead of a few tensor ops.
        """
        extra = 2 if self.measured else 0
        if not self.with_range:
            return torch.zeros(1 + extra, dtype=torch.float32, device=device)
        if host_scale is not None and device.type == "cpu":
            return _cpu_template(host_scale, extra).clone()
        # [0, 1, -1, 0...] * scale: the whole vector in one op (the scale is finite, never inf).
        if torch.compiler.is_compiling():  # a constant of the graph (dynamo skips lru_cache)
            pattern = torch.tensor([0.0, 1.0, -1.0] + [0.0] * extra, device=device)
        else:
            pattern = _pattern(device, extra)
        return pattern * copy_to(scale, device).reshape(()).float()

    def refusal(self, scale: torch.Tensor, device: torch.device, mark: float) -> torch.Tensor:
        """The leading fields of a rank that refuses its step: overflowed, measured as ``mark``."""
        parts = [torch.ones(1, device=device)]
        if self.with_range:
            scale = copy_to(scale, device).reshape(1).float()
            parts += [scale, -scale]
        if self.measured:
            parts.append(torch.tensor([mark, 0.0], device=device))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def append(
        self,
        vector: torch.Tensor,
        fields: list[tuple[Any, torch.Tensor]],
        spike: torch.Tensor | None,
    ) -> tuple[torch.Tensor, Layout]:
        """``vector`` with the registered ``(field, values)`` and the spike gate's slots appended,
        and the layout that says where they sit (this one when nothing is appended).

        One ``cat``; fields are sent as float32 with NaN as +inf (so a MAX cannot drop it: see
        :func:`all_reduce_flag`), the spike slots as they are (NaN-free where made). Each field
        is handed its slots in the result.
        """
        if not fields and spike is None:
            return vector, self
        layout = copy.copy(self)
        layout.slots = dict(self.slots)
        parts = [vector]
        for field, values in fields:
            layout._add(field, values.numel())
            parts.append(_nan_as_inf(values.to(vector.device, torch.float32).reshape(-1)))
        if spike is not None:
            layout._add(SPIKE, spike.numel())
            parts.append(spike)
        out = torch.cat(parts)
        layout.hand_over(out)
        return out, layout

    def refresh(self, vector: torch.Tensor) -> None:
        """Let registered fields that have ``refresh()`` rewrite their slots in ``vector``.

        For an agreement that ``unscale_()`` left for the flag's first read: the grads may have
        changed since the check (clipping, torch's AMP recipe), and a field whose values follow
        them (dscale.fp8's predicted post-step amaxes) sends them as the step will use them.
        ``refresh()`` returns the values anew (same length; NaN is sent as +inf) or None.
        """
        for key, where in self.slots.items():
            refresh = None if isinstance(key, str) else getattr(key, "refresh", None)
            values = None if refresh is None else refresh()
            if values is not None:
                vector[where] = _nan_as_inf(values.to(vector.device, torch.float32).reshape(-1))

    def verify(self) -> None:
        """Let registered fields that have ``verify()`` check their agreed slots (see
        :func:`verify_fields`)."""
        for key in self.slots:
            verify = None if isinstance(key, str) else getattr(key, "verify", None)
            if verify is not None:
                verify()

    def hand_over(self, vector: torch.Tensor) -> None:
        """Hand each registered field its slots in ``vector`` (the one that is all-reduced)."""
        for key in self.slots:
            if not isinstance(key, str):
                key.agreed(self.view(vector, key))


def verify_fields(layout: Layout) -> None:
    """Once the collective completed, before the step obeys it: each field that sent values
    and has ``verify()`` checks its agreed slots and may raise (dscale.fp8's NVFP4 check).

    Every rank holds the same agreed vector, so a refusal raised here is raised on every rank
    and no rank is left waiting in a collective. Only fields that sent values this step are in
    the layout (a check at the first step costs nothing later). In one process (no
    collective) the fields' own values are checked the same way.
    """
    layout.verify()


def _nan_as_inf(values: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(values, nan=math.inf, posinf=math.inf, neginf=-math.inf)


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


def all_reduce_flag(values: torch.Tensor, group: Any) -> Any:
    """Start a MAX all-reduce of the agreement vector ``values`` in place; return its work handle.

    MAX, not SUM: one rank's inf must skip the step on every rank, and the flag stays 0 or 1-ish
    whatever the world size. No field may hold a NaN: gloo's and NCCL's MAX drop a NaN sent by a
    non-zero rank (5.0 wins over NaN from rank 1; MS-AMP PR #58). Each field is NaN-free where it
    is made, so the seam adds no op: the flag is 0 or 1 (the check's kernel, flags folded as
    ``> 0``), the scale finite, predictive's and the spike gate's fields ``nan_to_num``-ed, and
    registered fields appended through :meth:`Layout.append`. The call is asynchronous; on NCCL
    ``work.wait()`` only makes the current CUDA stream wait, so the host never blocks here.
    """
    if torch.compiler.is_compiling():
        # Traced as _c10d_functional.all_reduce + wait_tensor (async_op=True does not trace);
        # the compiled graph orders it, so there is no handle to wait on.
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group, async_op=False)
        return None
    return dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group, async_op=True)
