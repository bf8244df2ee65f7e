"""What ``policy="predictive"`` measures on each rank: the largest gradient magnitude of the step.

The measurement reads the grad groups the check pass already builds and writes its result
straight into the agreement vector (``agreement``), in scaled units (the grads as the backward
left them). A rank whose grads hold an inf or NaN writes ``OVERFLOW_MARK`` instead, which is what
the rule needs from an overflowed step (``predictive``). The fastest exact form per device (a
maximum is exact in any order, so both give the same bits):

- on a GPU, one ``torch._foreach_norm(ord=inf)`` per (device, dtype) group (one multi-tensor
  kernel): four ops for one group, whatever the number of parameters;
- on the CPU, where that norm runs about 5x slower than ``abs`` + ``amax`` (2.1 ms against 0.5 ms
  for 200 x 4096 floats, one thread), ``abs`` + ``amax`` over chunks of at most ``CHUNK``
  elements, in one buffer per dtype that the measurement keeps: small grads are copied into it
  together (``torch._chunk_cat``, one op), a large one a view at a time, so no copy of every grad
  is ever made; the chunks are planned from the grads' sizes (``itertools.accumulate`` and
  ``bisect``: Python work per chunk, not per grad). A sampled step counts its underflowing
  elements from the same chunks, in the same pass. Fresh memory for every chunk cost about 100
  page faults a step in some processes and none in others (presumably as the allocator's history
  there decides): 2885 against 1410 us of overhead at 200 x 4096 fused, the same code in two
  processes. The kept buffer never faults; where fresh memory does not fault either, the buffer
  costs about 20 us more at 8 x 4096 and nothing measurable at 200 x 4096.

The CPU form also stands in for the check pass when the grads stay scaled (a fused optimizer
unscales them itself): the largest magnitude is inf or NaN exactly when some grad holds one, so
``write`` returns it and ``check_and_unscale_(..., checked=...)`` reads the flag from it instead of
reading and rewriting every grad (times 1). GPUs keep the check pass (one fused kernel).

Every ``sample_every`` steps it also writes ``1 +`` the share of gradient elements that underflow
in fp16 at the step's scale (below fp16's smallest normal number, as ``dscale.stats`` counts
them); 0 means "not sampled", so MAX over ranks keeps a real share and a fresh zero vector needs
no fill.

The reduction hooks of ``attach()`` measure the buckets and shards they reduce (unscaled by then)
into a small accumulator of their own (:func:`measure_reduced`), reset with their overflow flag.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch

from dscale.scaler._program.predictive import OVERFLOW_MARK
from dscale.scaler._program.unscale import GradGroups, copy_to, norms

#: fp16's smallest normal number. Scaled grads below it lose precision (subnormal) or flush to 0.
FP16_MIN_NORMAL = 2.0**-14
#: Steps between underflow samples (the count reads every element, as the check pass does).
UNDERFLOW_SAMPLE_EVERY = 100
#: Elements per chunk of the CPU form: 256 KiB of fp32, which stays in a core's L2 cache.
CHUNK = 2**16


def _largest(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The largest magnitude over ``tensors`` (inf/NaN if any holds one), one 0-d fp32 tensor."""
    if tensors and tensors[0].device.type == "cpu":
        return _measure_chunks(tensors, count_small=False)[0].float()
    return _largest_by_norm(tensors)


def _largest_by_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """:func:`_largest` as one multi-tensor inf-norm (the GPU form; any device works)."""
    if 0 in map(torch.Tensor.numel, tensors):  # the inf-norm of an empty tensor is an error
        tensors = [t for t in tensors if t.numel()]
        if not tensors:
            return torch.zeros((), dtype=torch.float32)
    found = norms(tensors, math.inf)
    value = found[0] if len(found) == 1 else torch.stack(found).amax()
    # fp64 grads' max is rounded to fp32 afterwards, as the CPU form does.
    return value.float() if value.dtype == torch.float64 else value


def _chunks(
    tensors: list[torch.Tensor], scratch: torch.Tensor | None
) -> Iterator[tuple[torch.Tensor, bool]]:
    """``tensors`` as flat pieces of at most ``CHUNK`` elements each (or one whole small grad).

    Yields ``(piece, owned)``: ``owned`` when the piece is a copy that may be written (several
    small grads flattened together, into ``scratch`` when given, or a non-contiguous grad), else
    a view of a grad.
    """
    sizes = list(map(torch.Tensor.numel, tensors))
    ends = list(itertools.accumulate(sizes))
    start, done = 0, 0  # the next tensor, and the elements before it
    while start < len(tensors):
        stop = max(bisect.bisect_right(ends, done + CHUNK, lo=start), start + 1)
        if ends[stop - 1] == done:  # empty grads only
            pass
        elif stop - start > 1:  # small grads, copied together
            yield _flatten(tensors[start:stop], sizes[start:stop], scratch), True
        else:  # one grad: views of it, CHUNK elements at a time
            flat = tensors[start].reshape(-1)
            owned = flat.data_ptr() != tensors[start].data_ptr()  # a copy (not contiguous)
            for piece in flat.split(CHUNK):
                yield piece, owned
        done, start = ends[stop - 1], stop


def _flatten(
    tensors: list[torch.Tensor], sizes: list[int], scratch: torch.Tensor | None
) -> torch.Tensor:
    """``tensors`` flattened together, into ``scratch`` where ``_chunk_cat`` can take them."""
    total = sum(sizes)
    # _chunk_cat refuses empty and 0-d tensors (only a 1-element grad can be 0-d).
    if scratch is None or 0 in sizes or (1 in sizes and 0 in map(torch.Tensor.dim, tensors)):
        return torch._C._nn.flatten_dense_tensors(tensors)
    flat = scratch[:total]
    torch._chunk_cat(tensors, 0, 1, out=flat.view(1, total))
    return flat


def _measure_chunks(
    tensors: list[torch.Tensor], *, count_small: bool, scratch: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU form: (largest magnitude as 0-d fp32, elements below fp16's smallest normal).

    fp64 tensors keep their largest magnitude in fp64: one above fp32's largest value is finite
    there, and rounded to fp32 it would read as an inf (the check's flag is taken from it).
    ``scratch``: ``CHUNK`` elements of the tensors' dtype to work in (else fresh memory).
    """
    largest: list[torch.Tensor] = []
    small: list[torch.Tensor] = []
    for piece, owned in _chunks(tensors, scratch):
        if owned:
            magnitudes = piece.abs_()
        elif scratch is None:
            magnitudes = piece.abs()
        else:
            magnitudes = torch.abs(piece, out=scratch[: piece.numel()])
        largest.append(magnitudes.amax())
        if count_small:
            small.append((magnitudes < FP16_MIN_NORMAL).sum())
    if not largest:  # no element at all
        zero = torch.zeros((), dtype=torch.float32)
        return zero, zero if count_small else None
    value = largest[0] if len(largest) == 1 else torch.stack(largest).amax()
    count = None
    if count_small:
        count = (small[0] if len(small) == 1 else torch.stack(small).sum()).float()
    return (value if value.dtype == torch.float64 else value.float()), count


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    # A per-tensor view; only on sampled steps (one in UNDERFLOW_SAMPLE_EVERY), off the CPU.
    return torch.cat([t.reshape(-1) for t in tensors])


def _count_small(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Elements below fp16's smallest normal number, as a 0-d fp32 tensor (off the CPU)."""
    return (_flat(tensors).abs() < FP16_MIN_NORMAL).sum().float()


class GradMeasure:
    """The sampling schedule and the measurement of the check pass's grad groups."""

    def __init__(self, sample_every: int = UNDERFLOW_SAMPLE_EVERY) -> None:
        self.sample_every = sample_every
        self.iteration = 0  # update() calls: the same on every rank, so ranks sample alike
        self._scratch: dict[torch.dtype, torch.Tensor] = {}  # the CPU form's, per dtype
        self._phase: torch.Tensor | None = None  # compiled iterations' schedule (device)
        # Set by a compiled iteration until an eager call counts it in `iteration` (settle()).
        self.counted_due = False

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
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Measure ``groups`` (scaled grads) into ``vector[at]`` and ``vector[at + 1]``.

        ``scale``: the step's scale. fp64 grads' value in the vector is capped at ``scale *
        2**127`` (two ops, fp64 measurements only): float32 holds it, but at a scale below 1 the
        rule's float32 entry ``g / s`` of a larger one is an inf, and BUDGET / inf made the next
        scale 0 (the device form's ring took inf * 0 = NaN and made it inf).

        ``hooks``: what the reduction hooks measured, ``[largest scaled magnitude, underflowing
        elements, elements]`` on ``vector``'s device. With neither, the fields stay 0 (nothing
        measured).

        Returns, when ``groups`` are all on the CPU, the largest magnitude before the overflow
        mark (a 0-d tensor on ``vector``'s device, inf or NaN exactly when a grad holds one, in
        fp64 where fp64 grads are measured; the hooks' value may be inf, an fp64 one beyond
        float32 included, but where hooks ran the check unscales and never reads this): what
        ``check_and_unscale_`` may read its flag from. Else None (a GPU keeps its check pass).
        """
        if torch.compiler.is_compiling():
            self._traced_write(vector, at, groups, hooks, scale)
            return None
        device, sampling = vector.device, self.sampling
        largest: list[torch.Tensor] = []
        small: list[torch.Tensor] = []
        on_cpu = True
        for place, per_dtype in groups.items():
            for dtype, tensors in per_dtype.items():
                if place.type == "cpu":
                    value, count = _measure_chunks(
                        tensors, count_small=sampling, scratch=self._scratch_for(dtype)
                    )
                else:
                    on_cpu = False
                    value = _largest(tensors)
                    count = _count_small(tensors) if sampling else None
                largest.append(copy_to(value, device))
                if count is not None:
                    small.append(copy_to(count, device))
        if hooks is not None:
            largest.append(hooks[0])
        if not largest:
            return None
        if len({t.dtype for t in largest}) > 1:  # fp64 grads' value with others: fp64, exact
            largest = [t.double() for t in largest]
        value = largest[0] if len(largest) == 1 else torch.stack(largest).amax()
        # fp32 for the vector: an fp64 value beyond fp32's range reads as an overflow there (the
        # rule's float32 arithmetic cannot take it), while `value`, returned for the check,
        # keeps it finite: the step is applied as torch's scaler applies it.
        torch.nan_to_num(value.float(), nan=OVERFLOW_MARK, posinf=OVERFLOW_MARK, out=vector[at])
        if scale is not None and any(torch.float64 in d for d in groups.values()):
            # (the GPU form's value is float32 already.) s * 2**127 is exact for a normal float32
            # s below 2 (and inf above: no cap): the rule's entry is then at most 2**127.
            cap = copy_to(scale, device).float().reshape(()) * 2.0**127
            torch.minimum(vector[at], cap, out=vector[at])
        if sampling:
            elements = float(sum(t.numel() for d in groups.values() for g in d.values() for t in g))
            if hooks is not None:
                small.append(hooks[1])
            total = torch.stack(small).sum() if small else torch.zeros((), device=device)
            count = hooks[2] + elements if hooks is not None else torch.tensor(elements)
            share = total / copy_to(torch.as_tensor(count, dtype=torch.float32), device).clamp(
                min=1.0
            )
            vector[at + 1].copy_(share + 1.0)
        return value if on_cpu and groups else None

    def sampling_flag(self, device: torch.device) -> torch.Tensor:
        """Under torch.compile: whether this iteration samples, as a 0-d bool on ``device``.

        The schedule's phase is a device counter (made at the first compiled iteration from
        :attr:`iteration`), so that no per-step Python number enters the traced region.
        """
        if self._phase is None or self._phase.device != device:
            self._phase = torch.full(
                (), self.iteration % self.sample_every, dtype=torch.int64, device=device
            )
        return self._phase == 0

    def _traced_write(
        self,
        vector: torch.Tensor,
        at: int,
        groups: GradGroups,
        hooks: torch.Tensor | None,
        scale: torch.Tensor | None,
    ) -> None:
        """:meth:`write` under torch.compile: the multi-tensor inf-norm (the GPU form, on every
        device: the same largest magnitude bit for bit), the underflow count every iteration,
        written where the device-side schedule samples (the same share as the eager form)."""
        device = vector.device
        largest: list[torch.Tensor] = []
        small: list[torch.Tensor] = []
        elements = 0.0
        for per_dtype in groups.values():
            for tensors in per_dtype.values():
                largest.append(copy_to(_largest_by_norm(tensors), device))
                small.append(copy_to(_count_small(tensors), device))
                elements += float(sum(t.numel() for t in tensors))
        if hooks is not None:
            largest.append(hooks[0])
        if not largest:
            return
        if len({t.dtype for t in largest}) > 1:
            largest = [t.double() for t in largest]
        value = largest[0] if len(largest) == 1 else torch.stack(largest).amax()
        mark = torch.nan_to_num(value.float(), nan=OVERFLOW_MARK, posinf=OVERFLOW_MARK)
        if scale is not None and any(torch.float64 in d for d in groups.values()):
            mark = torch.minimum(mark, copy_to(scale, device).float().reshape(()) * 2.0**127)
        vector[at].copy_(mark)
        if hooks is not None:
            small.append(hooks[1])
        total = torch.stack(small).sum() if small else torch.zeros((), device=device)
        count = hooks[2] + elements if hooks is not None else torch.tensor(elements)
        share = total / copy_to(torch.as_tensor(count, dtype=torch.float32), device).clamp(min=1.0)
        vector[at + 1].copy_(torch.where(self.sampling_flag(device), share + 1.0, vector[at + 1]))

    def _scratch_for(self, dtype: torch.dtype) -> torch.Tensor:
        """The CPU form's chunk buffer for ``dtype``, made once (CHUNK elements)."""
        scratch = self._scratch.get(dtype)
        if scratch is None:
            scratch = self._scratch[dtype] = torch.empty(CHUNK, dtype=dtype)
        return scratch

    def next_iteration(self) -> None:
        """Called by update(): the next step may be a sample."""
        if torch.compiler.is_compiling():  # the device phase counts compiled iterations
            assert self._phase is not None  # noqa: S101 - the compiled check made it
            self._phase.copy_((self._phase + 1) % self.sample_every)
            self.counted_due = True  # `iteration` counts it at the next eager call
            return
        self.settle()
        self.iteration += 1
        if self._phase is not None:  # kept (a new one would recompile the region), set alike
            self._phase.fill_(self.iteration % self.sample_every)

    def settle(self) -> None:
        """Count a compiled iteration in :attr:`iteration` (eagerly: no number in the graph),
        so that eager iterations after compiled ones sample on the same schedule."""
        if self.counted_due:
            self.counted_due = False
            self.iteration += 1

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_scratch", {})  # pickled at 0010076 or before: none kept
        self.__dict__.setdefault("_phase", None)
        self.__dict__.setdefault("counted_due", False)


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
    # An inf/NaN stays inf here and becomes the overflow mark only when GradMeasure.write
    # combines every unit's value, as without attach(): marked per unit, 65504 lost under MAX
    # to another unit's finite product above it (fp32/fp64 grads reach one).
    scaled = torch.nan_to_num(_largest(tensors).to(device) * scale, nan=math.inf, posinf=math.inf)
    torch.maximum(acc[0], scaled, out=acc[0])
    if sampling:
        flat = _flat(tensors)
        acc[1] += (flat.abs() * scale < FP16_MIN_NORMAL).sum()
        acc[2] += float(flat.numel())
    return acc
