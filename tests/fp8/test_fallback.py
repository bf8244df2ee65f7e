"""Float8Fallback: a layer whose sampled shares stay bad switches to high precision, exactly.

The oracle for "high precision" is ``torch.nn.functional.linear`` on the same weights: after
the switch the layer's output and gradients are bitwise equal to it (before, they differ).
"""

from __future__ import annotations

import pytest
import torch

import dscale
import dscale.fp8 as fp8
from tests.fp8 import _models


def _blow_up(module, args):
    bump = torch.zeros_like(args[0])
    bump.view(-1)[0] = args[0].detach().abs().max() * 1e4
    return (args[0] + bump,)


def _run(steps, *, fallback_state=None):
    model = _models.net()
    fp8.convert_to_float8(model, emulate=True)
    outlier = model.blocks[1].fc2.register_forward_pre_hook(_blow_up)  # every step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = dscale.StepGuard("cpu")
    numerics = fp8.Float8Numerics(model, guard, every=1)
    fallback = fp8.Float8Fallback(numerics, guard, threshold=0.05, samples=2)
    if fallback_state is not None:
        fallback.load_state_dict(fallback_state)
    fell_at = {}
    for step in range(steps):
        tokens, target = _models.batch(step)
        guard.scale(_models.loss_of(model, tokens, target)).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
        for name in fallback.fallen:
            fell_at.setdefault(name, step)
    outlier.remove()
    return model, fallback, fell_at


def _matches_linear(layer) -> bool:
    x = torch.randn(4, layer.in_features, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out = layer(x)
    ref = torch.nn.functional.linear(x_ref, layer.weight, layer.bias)
    out.sum().backward()
    grad_w = layer.weight.grad.clone()
    layer.weight.grad = None
    ref.sum().backward()
    return (
        torch.equal(out, ref)
        and torch.equal(x.grad, x_ref.grad)
        and torch.equal(grad_w, layer.weight.grad)
    )


def test_the_troubled_layer_alone_falls_back_after_k_samples_and_computes_as_linear():
    model, fallback, fell_at = _run(4)
    assert fallback.fallen == ["blocks.1.fc2"]
    assert fell_at == {"blocks.1.fc2": 1}  # the second sample above the threshold
    assert _matches_linear(model.blocks[1].fc2)
    assert not _matches_linear(model.blocks[0].fc1)  # still FP8: differs from nn.Linear


def test_the_fallen_set_is_kept_in_state_and_restored():
    _, fallback, _ = _run(3)
    state = fallback.state_dict()
    model, restored, _ = _run(0, fallback_state=state)
    assert restored.fallen == ["blocks.1.fc2"]
    assert _matches_linear(model.blocks[1].fc2)


def test_a_state_naming_other_layers_is_refused_and_changes_nothing():
    model = _models.net()
    fp8.convert_to_float8(model, emulate=True)
    guard = dscale.StepGuard("cpu")
    fallback = fp8.Float8Fallback(fp8.Float8Numerics(model, guard), guard)
    with pytest.raises(ValueError, match="does not convert"):
        fallback.load_state_dict({"fallen": ["blocks.0.fc1", "nope"], "runs": {}})
    assert fallback.fallen == []
    assert not _matches_linear(model.blocks[0].fc1)


def test_the_collector_exports_the_sample_and_the_switched_layer():
    from prometheus_client import CollectorRegistry, generate_latest

    model = _models.net()
    fp8.convert_to_float8(model, emulate=True)
    outlier = model.blocks[1].fc2.register_forward_pre_hook(_blow_up)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = dscale.StepGuard("cpu")
    numerics = fp8.Float8Numerics(model, guard, every=1)
    fallback = fp8.Float8Fallback(numerics, guard, threshold=0.05, samples=1)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(fp8.Float8NumericsCollector(numerics, fallback, rank=3))
    tokens, target = _models.batch(0)
    guard.scale(_models.loss_of(model, tokens, target)).backward()
    guard.step(opt)
    guard.update()
    outlier.remove()
    text = generate_latest(registry).decode()
    flushed = numerics.snapshot()["blocks.1.fc2/input"]["flushed"]
    assert flushed > 0.05
    line = 'dscale_fp8_flushed_ratio{layer="blocks.1.fc2",rank="3",tensor="input"} '
    assert f"{line}{flushed!r}" in text
    assert 'dscale_fp8_fallback{layer="blocks.1.fc2",rank="3"} 1.0' in text
    assert 'dscale_fp8_fallback_layers{rank="3"} 1.0' in text
    assert 'dscale_fp8_samples_total{rank="3"} 1.0' in text


def test_a_fallen_layer_trains_under_bf16_autocast_as_linear():
    # torchao's disabled-cast config alone mixes a bf16 grad with the fp32 weight in backward
    # under autocast ("expected m1 and m2 to have the same dtype"); the launcher's fp8 jobs
    # run under bf16 autocast.
    model = _models.net()
    fp8.convert_to_float8(model, emulate=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = dscale.StepGuard("cpu")
    numerics = fp8.Float8Numerics(model, guard, every=1)
    fallback = fp8.Float8Fallback(numerics, guard, threshold=1e-6, samples=1)
    for step in range(2):  # layers fall after step 0; step 1 trains them in high precision
        tokens, target = _models.batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _models.loss_of(model, tokens, target)
        guard.scale(loss).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
    assert fallback.fallen
    layer = dict(model.named_modules())[fallback.fallen[0]]
    x = torch.randn(4, layer.in_features)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert out.dtype == ref.dtype == torch.bfloat16 and torch.equal(out, ref)
