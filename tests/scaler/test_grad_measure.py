"""policy="predictive"'s measurement on the CPU: the chunked abs + amax form equals the inf-norm.

The oracle is the measurement as it was (one ``torch._foreach_norm(ord=inf)`` per group, and the
underflow count over one flat copy of every grad), written out below; a maximum and a count are
exact in any order, so the two must agree bit for bit, overflow marks and empty grads included.
Where the grads stay scaled, the measurement also gives the check's flag: the oracle is torch's
check pass over every grad, and the same training run with that pass.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import dscale
from dscale.scaler._program.grad_measure import CHUNK, FP16_MIN_NORMAL, GradMeasure, measure_reduced
from dscale.scaler._program.predictive import OVERFLOW_MARK
from dscale.scaler._program.unscale import check_and_unscale_, group_by_device_and_dtype
from tests.scaler._setup import decide_on_device


def _reference(groups, sampling: bool) -> torch.Tensor:
    """The measurement of e6f0fe2: [largest (overflow: the mark), 1 + underflowing share]."""
    largest, small, elements = [], [], 0
    for per_dtype in groups.values():
        for tensors in per_dtype.values():
            full = [t for t in tensors if t.numel()]
            if full:  # (float64 cannot be normed into float32: rounded after, the same bits)
                norms = torch._foreach_norm(full, math.inf)
                largest.append(torch.stack(norms).amax().float())
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
        dtype = rng.choice(
            [torch.float32, torch.float32, torch.float16, torch.bfloat16, torch.float64]
        )
        t = torch.randn(numel, generator=gen) * 2.0 ** rng.randrange(-30, 12)
        if numel == 1 and rng.random() < 0.5:  # a scalar parameter's grad (0-d)
            t = t.reshape(())
        if numel > 4 and rng.random() < 0.3:  # below fp16's smallest normal
            t[: numel // 4] *= 2.0**-20
        if numel > 1 and rng.random() < 0.1:
            t[rng.randrange(numel)] = rng.choice([math.inf, -math.inf, math.nan, -math.nan])
        t = t.to(dtype)
        if numel > 10 and rng.random() < 0.3:  # a non-contiguous grad
            t = t[: numel // 2 * 2].view(2, -1).t()
        out.append(t)
    return out


@pytest.mark.parametrize("sampling", [False, True], ids=["measured", "sampled"])
def test_the_cpu_measurement_equals_the_inf_norm_bit_for_bit(sampling: bool) -> None:
    rng = random.Random(34)
    # One measurement for every case, as a scaler keeps it: its chunk buffers hold the last
    # case's values when the next one starts.
    measure = GradMeasure(sample_every=1 if sampling else 10**9)
    measure.iteration = 1
    for case in range(20):
        grads = _grads(rng)
        before = [g.clone() for g in grads]
        groups = group_by_device_and_dtype(grads)
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


def test_where_grads_stay_scaled_the_measurement_gives_the_check_pass_flag() -> None:
    # A fused optimizer unscales in its own kernel, so the check multiplies by 1: its flag is
    # all it gives. The measurement returns the largest magnitude, inf or NaN exactly when a grad
    # holds one; checked from that value, the flag must be the pass's and every grad untouched.
    rng = random.Random(4)
    measure = GradMeasure(sample_every=10**9)
    measure.iteration = 1
    unit = torch.ones(())
    overflowed = 0
    for case in range(40):
        grads = _grads(rng)
        before = [g.clone() for g in grads]
        versions = [g._version for g in grads]
        groups = group_by_device_and_dtype(grads)
        expected = torch.zeros(())
        for per_dtype in group_by_device_and_dtype(before).values():  # torch's pass, on copies
            for tensors in per_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, expected, unit)
        checked = measure.write(torch.zeros(2), 0, groups)
        assert checked is not None, case
        flag = torch.zeros(())
        check_and_unscale_(groups, unit, flag, checked)
        assert torch.equal(flag, expected), (case, flag, expected)
        overflowed += int(expected.item())
        assert [g._version for g in grads] == versions, case  # no grad read and rewritten
        for grad, old in zip(grads, before, strict=True):  # what x1 would have left
            assert torch.equal(grad, old) or torch.equal(grad.isnan(), old.isnan()), case
    assert 5 <= overflowed <= 35, overflowed  # both outcomes were tried


class _CheckedTensors:
    """Records what each call of torch's check-and-unscale kernel was given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[list[torch.Tensor]] = []
        real = torch._amp_foreach_non_finite_check_and_unscale_

        def recorded(tensors, found, inv_scale):
            self.calls.append(list(tensors))
            return real(tensors, found, inv_scale)

        monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", recorded)


def _fused_run(make_opt, *, on_device: bool, dtype: torch.dtype, poison: dict[int, float]) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    opt = make_opt(model.parameters())
    scaler = dscale.GradScaler("cpu", init_scale=2.0**6, policy="predictive")
    if on_device:
        decide_on_device(scaler)
    snapshots = []
    for step in range(8):
        torch.manual_seed(100 + step)
        opt.zero_grad()
        scaler.scale(model(torch.randn(5, 6, dtype=dtype)).float().square().mean()).backward()
        if step in poison:
            model[2].weight.grad[1, 2] = poison[step]
        scaler.step(opt)
        scaler.update()
        snapshot = scaler.snapshot()
        snapshots.append({k: snapshot[k] for k in ("scale", "skipped_steps", "grad_max_abs")})
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": [
            {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for s in opt.state.values()
        ],
        "scaler": scaler.state_dict(),
        "snapshots": snapshots,
    }


@pytest.mark.parametrize(
    "name",
    ["adam-fused", "adamw-fused", "sgd-fused"],
)
def test_a_fused_predictive_run_equals_the_same_run_with_the_check_pass(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    make_opt = {
        "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
        "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
        "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    }[name]
    poison = {2: math.inf, 3: -math.inf, 5: math.nan}
    real_write = GradMeasure.write

    def withheld(self, *args, **kwargs) -> None:  # measures, returns nothing to check from
        real_write(self, *args, **kwargs)

    # The device decision (CUDA's path, forced) with fp32 grads; the host decision (the CPU's)
    # with fp16 and bf16 grads: with fp32 ones at a power-of-two scale the host unscales them
    # in the check pass (the pass it makes anyway there), so that pass stays. (torch's fused SGD
    # with momentum on fp16/bf16 CPU parameters gives momentum buffers that differ from one run to
    # the next, dscale or not: fp32 only there.)
    cases = [(True, torch.float32), (False, torch.float16), (False, torch.bfloat16)]
    for on_device, dtype in cases[:1] if name == "sgd-fused" else cases:
        calls = _CheckedTensors(monkeypatch)
        folded = _fused_run(make_opt, on_device=on_device, dtype=dtype, poison=poison)
        # Every check read the one measured value, never the grads.
        assert calls.calls and all(len(c) == 1 and c[0].dim() == 0 for c in calls.calls), name
        monkeypatch.undo()
        # The oracle: the same run, the measurement's value withheld, so the pass checks every grad.
        monkeypatch.setattr(GradMeasure, "write", withheld)
        calls = _CheckedTensors(monkeypatch)
        checked = _fused_run(make_opt, on_device=on_device, dtype=dtype, poison=poison)
        assert all(len(c) >= 4 for c in calls.calls), name  # the grads of 4 parameters
        monkeypatch.undo()
        skipped = [s["skipped_steps"] for s in folded["snapshots"]]
        assert skipped == [0, 0, 1, 2, 2, 3, 3, 3], (name, dtype, skipped)
        assert folded["snapshots"] == checked["snapshots"], (name, dtype)
        assert folded["scaler"] == checked["scaler"], (name, dtype)
        for p, q in zip(folded["params"], checked["params"], strict=True):
            assert torch.equal(p, q), (name, dtype)
        for s, t in zip(folded["state"], checked["state"], strict=True):
            assert s.keys() == t.keys()
            for key in s:
                assert torch.equal(torch.as_tensor(s[key]), torch.as_tensor(t[key])), key


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_a_negative_nan_or_inf_anywhere_reads_as_an_overflow(dtype: torch.dtype) -> None:
    # A NaN or inf of either sign, in views of a large grad or in a chunk of small ones, reads as
    # an overflow in the vector and in the value the check reads its flag from.
    measure = GradMeasure(sample_every=10**9)
    measure.iteration = 1
    for bad in (-math.nan, math.nan, -math.inf, math.inf, None):
        for numel, at in ((3 * CHUNK + 5, CHUNK + 1000), (300, 7)):  # views / a shared chunk
            grads = [torch.full((numel,), -2.0, dtype=dtype), torch.ones(300, dtype=dtype)]
            if bad is not None:
                grads[0][at] = bad
            vector = torch.zeros(2)
            checked = measure.write(vector, 0, group_by_device_and_dtype(grads))
            assert checked is not None
            if bad is None:
                assert vector[0].item() == checked.item() == 2.0, dtype
            else:
                assert vector[0].item() == OVERFLOW_MARK, (dtype, bad)
                assert not checked.isfinite(), (dtype, bad)
