"""Float8Numerics: exact against a brute-force reference, quiet when unsampled, and local.

The reference rounds every element to the nearest value of a table of all 256 bit patterns of
the format (ties to even), independently of torch's float8 cast.
"""

from __future__ import annotations

import pytest
import torch

import dscale
import dscale.fp8 as fp8
from tests.fp8 import _models


def _reference(x: torch.Tensor, dtype: torch.dtype) -> list[float]:
    info = torch.finfo(dtype)
    table = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    table = table[torch.isfinite(table)].double().unique()
    xs = x.double().flatten()
    amax = xs.abs().max().item()
    scale = torch.tensor(info.max / amax, dtype=torch.float32).double()  # torchao's, in fp32
    sat = flushed = sub = 0
    for v in (xs * scale).tolist():
        if abs(v) > info.max:
            sat += 1
        c = min(max(v, -info.max), info.max)
        d = (table - c).abs()
        best = table[d == d.min()]
        if len(best) > 1:  # a tie: the value with an even mantissa (an even bit pattern)
            pats = [
                int(torch.tensor(b, dtype=torch.float32).to(dtype).view(torch.uint8))
                for b in best.tolist()
            ]
            q = best[[p % 2 == 0 for p in pats].index(True)].item()
        else:
            q = best.item()
        if v != 0 and q == 0:
            flushed += 1
        if q != 0 and abs(q) < info.smallest_normal:
            sub += 1
    n = xs.numel()
    return [amax, sat / n, flushed / n, sub / n]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_stats_match_the_brute_force_reference(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, generator=g) * torch.logspace(-9, 0, 2048)  # many tiny values
    x[7] = 0.0
    ours = fp8.tensor_stats(x, dtype).tolist()
    want = _reference(x, dtype)
    assert ours[0] == pytest.approx(want[0], rel=1e-6)
    assert ours[1:] == pytest.approx(want[1:], abs=1e-9)
    assert ours[2] > 0 and ours[3] > 0  # the case is not trivial


def _train(numerics_every, outlier_at=None, steps=4, keep=None):
    model = _models.net()
    fp8.convert_to_float8(model, keep_high_precision=keep, emulate=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = dscale.StepGuard("cpu")
    numerics = None
    if numerics_every is not None:
        numerics = fp8.Float8Numerics(model, guard, every=numerics_every)
    if outlier_at is not None:

        def blow_up(module, args):
            bump = torch.zeros_like(args[0])
            bump[0, 0, 0] = args[0].detach().abs().max() * 1e4
            return (args[0] + bump,)

        dict(model.named_modules())[outlier_at].register_forward_pre_hook(blow_up)
    ops = []
    for step in range(steps):
        tokens, target = _models.batch(step)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loss = _models.loss_of(model, tokens, target)
            guard.scale(loss).backward()
            guard.step(opt)
            guard.update()
            opt.zero_grad()
        ops.append(sum(1 for e in prof.events() if e.name.startswith("aten::")))
    return numerics, ops


def test_unsampled_steps_dispatch_no_extra_op():
    """Oracle: the same run without numerics (issue 41 item 8: not one with numerics that
    samples rarely). The 2-rank attach() case is in test_numerics_ranks.py."""
    _, plain = _train(numerics_every=None, steps=3)
    numerics, ops = _train(numerics_every=2, steps=3)  # steps 0 and 2 sampled
    assert ops[1] == plain[1]  # step 1: unsampled, not one op more
    assert ops[2] > plain[2]
    assert numerics.num_samples == 2


def test_an_outlier_flags_only_its_layer():
    numerics, _ = _train(numerics_every=1, outlier_at="blocks.1.fc2", steps=1)
    snap = numerics.snapshot()
    assert set(snap) == {
        f"blocks.{b}.{fc}/{t}"
        for b in (0, 1)
        for fc in ("fc1", "fc2")
        for t in ("input", "weight", "grad_output")
    }
    flagged = {k for k, row in snap.items() if row["flushed"] > 0.05}
    assert flagged == {"blocks.1.fc2/input"}


def test_bad_every_is_refused():
    model = _models.net()
    fp8.convert_to_float8(model, emulate=True)
    with pytest.raises(ValueError, match="every must be a positive int"):
        fp8.Float8Numerics(model, dscale.StepGuard("cpu"), every=0)


def test_numerics_state_is_keyed_by_layer_name_and_another_models_is_refused():
    """The state names its layers: another conversion with as many float8 layers is refused,
    naming both sides, and leaves the schedule and the last sample as they were; the same
    model's state restores them exactly (oracle: the saving object's own snapshot)."""
    saved, _ = _train(numerics_every=2, steps=3, keep=["blocks.0.fc1"])  # samples at 0, 2
    state = saved.state_dict()
    assert state["num_steps"].item() == 3 and state["sample_step"].item() == 2
    other = _models.net()
    fp8.convert_to_float8(other, keep_high_precision=["blocks.1.fc2"], emulate=True)
    numerics = fp8.Float8Numerics(other, dscale.StepGuard("cpu"), every=2)
    assert len(numerics.layers) == len(saved.layers) == 3  # as many layers, not the same
    with pytest.raises(
        ValueError,
        match=r"not in this model: \['blocks\.1\.fc2'\]; not in the state: \['blocks\.0\.fc1'\]",
    ):
        numerics.load_state_dict(state)
    assert (numerics.num_steps, numerics.snapshot()) == (0, {})
    with pytest.raises(ValueError, match="format version 1"):
        numerics.load_state_dict({"num_steps": 3, "num_samples": 2})
    same = _models.net()
    fp8.convert_to_float8(same, keep_high_precision=["blocks.0.fc1"], emulate=True)
    restored = fp8.Float8Numerics(same, dscale.StepGuard("cpu"), every=2)
    restored.load_state_dict(state)
    assert restored.snapshot() == saved.snapshot() != {}
    assert (restored.num_steps, restored.num_samples, restored.sample_step) == (3, 2, 2)


def _wrapped_run(wrap, steps=2):
    """Numerics and a fallback over the test model, its blocks wrapped by ``wrap``."""
    from tests.fp8.test_fallback import _blow_up

    model = _models.net()
    fp8.convert_to_float8(model, emulate=True)
    model.blocks[1].fc2.register_forward_pre_hook(_blow_up)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = wrap(block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = dscale.StepGuard("cpu")
    numerics = fp8.Float8Numerics(model, guard, every=1)
    fallback = fp8.Float8Fallback(numerics, guard, threshold=0.05, samples=2)
    for step in range(steps):
        tokens, target = _models.batch(step)
        guard.scale(_models.loss_of(model, tokens, target)).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
    return numerics, fallback


def test_layer_names_are_the_bare_models_under_wrappers_inside_the_model():
    """Review of issue 41 (items 7, 10): names dropped only leading ``module.``/``_orig_mod.``,
    so blocks wrapped inside the model (activation checkpointing, torch.compile of each block,
    as torchtitan does) were named ``blocks.0._checkpoint_wrapped_module.fc1``: a state saved
    without the wrapper was refused by the same model with it (and the reverse); and a model's
    own ``module`` child beside others lost its prefix, so ``module.fc`` and ``fc`` collided
    into one key (one layer dropped from the fallback and the state). Oracle: the bare model's
    names, snapshot and switched layers; its states load into the wrapped one."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    bare_numerics, bare_fallback = _wrapped_run(lambda block: block)
    names = [n for n, _ in bare_numerics.layers]
    assert names == ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]
    numerics, fallback = _wrapped_run(checkpoint_wrapper)
    assert [n for n, _ in numerics.layers] == names
    assert numerics.snapshot() == bare_numerics.snapshot()
    assert fallback.fallen == bare_fallback.fallen == ["blocks.1.fc2"]
    fresh, fresh_fallback = _wrapped_run(checkpoint_wrapper, steps=0)
    fresh.load_state_dict(bare_numerics.state_dict())
    fresh_fallback.load_state_dict(bare_fallback.state_dict())
    assert fresh_fallback.fallen == ["blocks.1.fc2"]

    compiled = _models.net()  # compiled per block and whole (names only: nothing runs)
    fp8.convert_to_float8(compiled, emulate=True)
    compiled.blocks[1] = torch.compile(compiled.blocks[1])
    guard = dscale.StepGuard("cpu")
    whole = fp8.Float8Numerics(torch.compile(compiled), guard, every=1)
    assert [n for n, _ in whole.layers] == names
    whole.close()

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(32, 32)

    class Outer(torch.nn.Module):  # its own "module" child beside another: not a wrapper
        def __init__(self):
            super().__init__()
            self.module = Inner()
            self.fc = torch.nn.Linear(32, 32)

    outer = Outer()
    fp8.convert_to_float8(outer, emulate=True)
    numerics = fp8.Float8Numerics(outer, dscale.StepGuard("cpu"), every=1)
    assert [n for n, _ in numerics.layers] == ["fc", "module.fc"]
    assert len(fp8.Float8Fallback(numerics, dscale.StepGuard("cpu")).runs) == 2


def test_tensorwise_stats_use_torchaos_float64_scale_and_cast():
    """Oracle: torchao's own cast (``amax_to_scale``, which divides in float64 then rounds to
    float32, and ``hp_tensor_and_scale_to_float8``). With amax 3.0, 448 / 3 in float32 (torch's
    scalar / tensor is a reciprocal times 448) is one ulp above torchao's scale, so the amax
    element scaled to 448.00003 counted as saturated (0.25 here) though torchao's cast maps it
    to exactly 448 (r43n)."""
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale

    g = torch.Generator().manual_seed(3)
    cases = [torch.tensor([3.0, 1.0, -0.5, 0.25]), torch.tensor([-6.0, 2.0, 1e-6, 0.0])]
    cases += [torch.randn(64, generator=g) * float(k) for k in (0.01, 0.7, 2.9, 13.0, 1e3)]
    cases += [(torch.randn(64, generator=g) * 7).bfloat16()]
    for x in cases:
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            info = torch.finfo(dtype)
            amax = x.abs().amax().float()
            scale = amax_to_scale(amax, dtype)
            q = hp_tensor_and_scale_to_float8(x, scale, dtype)._data.float()
            n = x.numel()
            xf = x.float()
            want = [
                amax.item(),
                ((xf * scale).abs() > info.max).sum().item() / n,
                ((xf != 0) & (q == 0)).sum().item() / n,
                ((q != 0) & (q.abs() < info.smallest_normal)).sum().item() / n,
            ]
            ours = fp8.tensor_stats(x, dtype).tolist()
            assert ours == pytest.approx(want, abs=0, rel=0), (x, dtype)


@pytest.mark.xfail(
    strict=True,
    reason="r43n, listed: 'saturated' counts |x * scale| > fp8_max before the clamp, so under "
    "torchao's own dynamic scale an amax element that rounds to 448.00003 counts as saturated "
    "though the clamp changes nothing (448.00003 rounds to 448 anyway); on tensors under ~1000 "
    "elements that one element passes DScaleFP8Saturation's 0.001 and the proposal's "
    "max_saturated. Counting only elements that round beyond the maximum changes every "
    "recipe's definition and brute-force reference.",
)
def test_the_amax_element_under_its_own_dynamic_scale_is_never_saturated():
    """Oracle: torchao's cast of [13, 1, -0.5, 0.25] equals its unclamped rounding (the amax
    element lands on 448 either way): nothing was clipped."""
    x = torch.tensor([13.0, 1.0, -0.5, 0.25])
    assert fp8.tensor_stats(x, torch.float8_e4m3fn)[1].item() == 0.0
