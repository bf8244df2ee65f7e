"""policy="predictive"'s measurement on the CPU: the chunked abs + amax form equals the inf-norm.

The oracle is the measurement as it was (one ``torch._foreach_norm(ord=inf)`` per group, and the
underflow count over one flat copy of every grad), written out below; a maximum and a count are
exact in any order, so the two must agree bit for bit, overflow marks and empty grads included.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dscale._grad_measure import CHUNK, FP16_MIN_NORMAL, GradMeasure, measure_reduced
from dscale._predictive import OVERFLOW_MARK
from dscale._unscale import group_by_device_and_dtype


def _reference(groups, sampling: bool) -> torch.Tensor:
    """The measurement of e6f0fe2: [largest (overflow: the mark), 1 + underflowing share]."""
    largest, small, elements = [], [], 0
    for per_dtype in groups.values():
        for tensors in per_dtype.values():
            full = [t for t in tensors if t.numel()]
            if full:
                norms = torch._foreach_norm(full, math.inf, dtype=torch.float32)
                largest.append(torch.stack(norms).amax())
            else:
                largest.append(torch.zeros(()))
            flat = torch.cat([t.reshape(-1) for t in tensors])
            small.append((flat.abs() < FP16_MIN_NORMAL).sum().float())
            elements += flat.numel()
    out = torch.zeros(2)
    value = torch.stack(largest).amax()
    out[0] = torch.nan_to_num(value, nan=OVERFLOW_MARK, posinf=OVERFLOW_MARK)
    if sampling:
        out[1] = torch.stack(small).sum() / max(float(elements), 1.0) + 1.0
    return out


def _grads(rng: random.Random) -> list[torch.Tensor]:
    """Grads of mixed sizes around CHUNK, dtypes, layouts, tiny values, and now and then inf/NaN."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    out = []
    for _ in range(rng.randrange(1, 9)):
        numel = rng.choice([0, 1, 7, 300, 300, 300, CHUNK - 1, CHUNK, CHUNK + 5, 2 * CHUNK + 11])
        dtype = rng.choice([torch.float32, torch.float32, torch.float16, torch.bfloat16])
        t = torch.randn(numel, generator=gen) * 2.0 ** rng.randrange(-30, 12)
        if numel > 4 and rng.random() < 0.3:  # below fp16's smallest normal
            t[: numel // 4] *= 2.0**-20
        if numel > 1 and rng.random() < 0.1:
            t[rng.randrange(numel)] = rng.choice([math.inf, -math.inf, math.nan])
        t = t.to(dtype)
        if numel > 10 and rng.random() < 0.3:  # a non-contiguous grad
            t = t[: numel // 2 * 2].view(2, -1).t()
        out.append(t)
    return out


@pytest.mark.parametrize("sampling", [False, True], ids=["measured", "sampled"])
def test_the_cpu_measurement_equals_the_inf_norm_bit_for_bit(sampling: bool) -> None:
    rng = random.Random(34)
    for case in range(20):
        grads = _grads(rng)
        before = [g.clone() for g in grads]
        groups = group_by_device_and_dtype(grads)
        measure = GradMeasure(sample_every=1 if sampling else 10**9)
        measure.iteration = 1
        vector = torch.zeros(2)
        measure.write(vector, 0, groups)
        expected = _reference(groups, sampling)
        assert torch.equal(vector, expected), (case, vector, expected)
        for grad, old in zip(grads, before, strict=True):  # the grads are read, never written
            assert torch.equal(grad, old) or (grad.isnan() == old.isnan()).all(), case


def test_the_hooks_measurement_of_a_bucket_is_unchanged() -> None:
    gen = torch.Generator().manual_seed(0)
    bucket = [torch.randn(3 * CHUNK + 5, generator=gen)]  # a DDP bucket: one flat tensor
    scale = torch.tensor(2.0**10)
    acc = measure_reduced(None, bucket, scale, sampling=False)
    expected = torch._foreach_norm(bucket, math.inf, dtype=torch.float32)[0] * scale
    assert torch.equal(acc[0], expected)


class _LargestOutput(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t._base is None:  # a new tensor, not a view
                self.largest = max(self.largest, t.numel())
        return out


def test_the_cpu_measurement_never_copies_every_grad_at_once() -> None:
    # 200 x 4096 floats, the case: no tensor made during the measurement, a sampled
    # step's included, holds more than CHUNK elements (the old sampled count made one of 819200).
    gen = torch.Generator().manual_seed(1)
    groups = group_by_device_and_dtype([torch.randn(4096, generator=gen) for _ in range(200)])
    measure = GradMeasure(sample_every=1)
    vector = torch.zeros(2)
    with _LargestOutput() as mode:
        measure.write(vector, 0, groups)
    assert 0 < mode.largest <= CHUNK, mode.largest
