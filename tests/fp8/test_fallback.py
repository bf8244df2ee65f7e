"""Float8Fallback: a layer whose sampled shares stay bad switches to high precision, exactly.

The oracle for "high precision" is ``torch.nn.functional.linear`` on the same weights: after
the switch the layer's output and gradients are bitwise equal to it (before, they differ).
"""

from __future__ import annotations

import copy

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


def _build(keep=None, outlier="blocks.1.fc2", every=2, samples=3):
    model = _models.net()
    fp8.convert_to_float8(model, keep_high_precision=keep, emulate=True)
    if outlier is not None:
        dict(model.named_modules())[outlier].register_forward_pre_hook(_blow_up)  # every step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = dscale.StepGuard("cpu")
    numerics = fp8.Float8Numerics(model, guard, every=every)
    fallback = fp8.Float8Fallback(numerics, guard, threshold=0.05, samples=samples)
    return model, opt, guard, numerics, fallback


def _steps(run, steps):
    model, opt, guard, _, fallback = run
    out = []
    for step in steps:
        tokens, target = _models.batch(step)
        loss = _models.loss_of(model, tokens, target)
        guard.scale(loss).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
        out.append((step, loss.item(), list(fallback.fallen), dict(fallback.runs)))
    return out


def test_a_resume_at_an_unsampled_step_switches_the_layers_of_the_uninterrupted_run(tmp_path):
    """Issue 41 item 9: resumed at a step that is not sampled, the fallback took the restored
    sample count for a new sample, read the (empty) snapshot and zeroed every run, so the layer
    the uninterrupted run switches after its third sample (step 4) never switched. Oracle: the
    uninterrupted run, bit for bit (losses, the switched layers and every run, at every step),
    resumed from in-memory state dicts and through dscale.checkpoint (DCP) at steps 1 and 3."""
    from dscale.checkpoint import CheckpointManager, load_checkpoint

    whole = _steps(_build(), range(7))
    assert whole[4][2] == ["blocks.1.fc2"] and whole[3][2] == []  # falls at step 4's sample
    for at in (1, 3):  # samples at 0, 2, 4, 6: resumed before the unsampled steps 1 and 3
        first = _build()
        assert _steps(first, range(at)) == whole[:at]
        model, opt, guard, numerics, fallback = first
        states = {
            "model": copy.deepcopy(model.state_dict()),
            "opt": copy.deepcopy(opt.state_dict()),
            "guard": guard.state_dict(),
            "numerics": copy.deepcopy(numerics.state_dict()),
            "fallback": copy.deepcopy(fallback.state_dict()),
        }
        ckpt = CheckpointManager(tmp_path / f"at{at}", every=0, keep=1)
        ckpt.save(
            at,
            model=model,
            optimizer=opt,
            scaler=guard,
            extra={"fp8_numerics": numerics, "fp8_fallback": fallback},
        )
        ckpt.wait()
        resumed = _build()
        resumed[0].load_state_dict(states["model"])
        resumed[1].load_state_dict(states["opt"])
        resumed[2].load_state_dict(states["guard"])
        resumed[3].load_state_dict(states["numerics"])
        resumed[4].load_state_dict(states["fallback"])
        assert _steps(resumed, range(at, 7)) == whole[at:], at
        loaded = _build()
        step = load_checkpoint(
            tmp_path / f"at{at}" / f"step-{at}",
            model=loaded[0],
            optimizer=loaded[1],
            scaler=loaded[2],
            extra={"fp8_numerics": loaded[3], "fp8_fallback": loaded[4]},
        )
        assert step == at
        assert loaded[3].snapshot() == numerics.snapshot()  # the last sample came back too
        assert _steps(loaded, range(at, 7)) == whole[at:], at


def test_fallback_state_loads_by_layer_name_and_refuses_other_layers_of_the_same_count(tmp_path):
    """Issue 41 item 10: the state's tensor form (what checkpoints hold) was positional over the
    sorted float8 layers, so a model with as many float8 layers but other ones switched whichever
    layer sat at the saved position (here blocks.0.fc1 for blocks.0.fc2). It is keyed by name:
    the other model refuses it, naming the layers on both sides, and stays in FP8 (in memory and
    through dscale.checkpoint); the same model switches exactly the saved layer (oracle:
    nn.Linear's output and gradients, bit for bit)."""
    from dscale.checkpoint import CheckpointManager, load_checkpoint

    saved = _build(keep=["blocks.0.fc1"], outlier="blocks.0.fc2", every=1, samples=1)
    _steps(saved, range(1))
    assert saved[4].fallen == ["blocks.0.fc2"]
    state = saved[4].state_dict()
    ckpt = CheckpointManager(tmp_path, every=0, keep=1)
    ckpt.save(1, extra={"fp8_fallback": saved[4]})
    ckpt.wait()

    other = _build(keep=["blocks.1.fc2"], outlier=None)  # 3 float8 layers, as saved
    assert [n for n, _ in other[3].layers] == ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1"]
    with pytest.raises(ValueError, match=r"not in this model: \['blocks\.1\.fc2'\]"):
        other[4].load_state_dict(copy.deepcopy(state))
    with pytest.raises(ValueError, match=r"not in the state: \['blocks\.0\.fc1'\]"):
        other[4].load_state_dict(copy.deepcopy(state))
    with pytest.raises(Exception, match=r"blocks\.0\.fc1"):
        load_checkpoint(tmp_path / "step-1", extra={"fp8_fallback": other[4]})
    assert other[4].fallen == []
    assert not any(_matches_linear(m) for _, m in other[3].layers)  # every layer still FP8

    same = _build(keep=["blocks.0.fc1"], outlier=None)
    load_checkpoint(tmp_path / "step-1", extra={"fp8_fallback": same[4]})
    assert same[4].fallen == ["blocks.0.fc2"]
    modules = dict(same[3].layers)
    assert _matches_linear(modules["blocks.0.fc2"])
    assert not _matches_linear(modules["blocks.1.fc1"])


def test_the_positional_tensor_state_of_earlier_versions_is_refused_and_changes_nothing():
    """The earlier positional form cannot be checked against the model's layers."""
    run = _build()
    with pytest.raises(ValueError, match="by position"):
        run[4].load_state_dict(
            {"fallen": torch.tensor([3, -1, -1, -1]), "runs": torch.tensor([0, 0, 0, 2])}
        )
    assert run[4].fallen == [] and set(run[4].runs.values()) == {0}


def test_a_state_switching_a_float8_all_gather_layer_is_refused_and_changes_nothing():
    """Such a layer's weight arrives already cast, so the fallback never switches it (it is
    left, with a warning); a state saying it fell (from a run without float8 all-gather) is
    refused instead of switching it."""
    model = _models.net()
    fp8.convert_to_float8(model, float8_all_gather=True, emulate=True)
    guard = dscale.StepGuard("cpu")
    fallback = fp8.Float8Fallback(fp8.Float8Numerics(model, guard), guard)
    with pytest.raises(ValueError, match=r"switches \['blocks\.0\.fc1'\], whose weights"):
        fallback.load_state_dict({"fallen": ["blocks.0.fc1"], "runs": {}})
    assert fallback.fallen == []
    assert model.blocks[0].fc1.config.cast_config_input.scaling_type.value != "disabled"


def _two_optimizer_steps(split, unscale_first, every, steps=7):
    """``split``: AdamW over the first half of the parameters and one over the rest, stepped
    in one iteration (torch's recipe for several optimizers, with ``unscale_`` of each first
    or not); else one AdamW over all."""
    model = _models.net()
    fp8.convert_to_float8(model, emulate=True)
    model.blocks[1].fc2.register_forward_pre_hook(_blow_up)
    params = list(model.parameters())
    groups = [params[: len(params) // 2], params[len(params) // 2 :]] if split else [params]
    opts = [torch.optim.AdamW(g, lr=1e-3) for g in groups]
    guard = dscale.StepGuard("cpu")
    numerics = fp8.Float8Numerics(model, guard, every=every)
    fallback = fp8.Float8Fallback(numerics, guard, threshold=0.05, samples=2)
    out = []
    for step in range(steps):
        tokens, target = _models.batch(step)
        loss = _models.loss_of(model, tokens, target)
        guard.scale(loss).backward()
        for opt in opts if unscale_first else ():
            guard.unscale_(opt)
        for opt in opts:
            guard.step(opt)
        guard.update()
        for opt in opts:
            opt.zero_grad()
        out.append(
            (
                loss.item(),
                numerics.snapshot(),
                list(fallback.fallen),
                dict(fallback.runs),
                numerics.num_steps,
                numerics.num_samples,
            )
        )
    return out


@pytest.mark.parametrize(("unscale_first", "every"), [(False, 1), (True, 2)])
def test_with_two_optimizers_the_samples_and_switches_are_the_one_optimizer_runs(
    unscale_first, every
):
    """Review of issue 41 (items 8, 9): the numerics counted every step() call, so with two
    optimizers (a) the second optimizer's step of a sampled iteration was sampled too: it saw no
    forward and sent zeros, every snapshot read all zeros and the fallback, deciding on them,
    never switched the troubled layer; (b) with unscale_() of both first, every=2 sampled every
    iteration (two steps each) and switched the layer an iteration early. Oracle: the same
    training with one AdamW over every parameter (AdamW is per parameter, so the losses are
    bitwise equal): the same snapshots, switched layers, runs and counts at every iteration."""
    one = _two_optimizer_steps(False, unscale_first, every)
    two = _two_optimizer_steps(True, unscale_first, every)
    assert one[every][2] == ["blocks.1.fc2"]  # the oracle switches it at its second sample
    assert [r[1:3] for r in two] == [r[1:3] for r in one]  # the same samples and switches
    assert [r[0] for r in two] == [r[0] for r in one]  # so the same training
    assert two == one


def test_a_fallback_decides_on_no_sample_twice_once_its_numerics_closed():
    """Review of issue 41 (item 9): closed right after a sampled step, the numerics stopped
    counting steps, so "the step just finished was sampled" stayed true and the fallback read the
    same old sample on every later step: the troubled layer switched after one sample where
    ``samples=3`` asks for three. Oracle: the count of samples the numerics took (1): no run may
    exceed it, and nothing switches."""
    model = _models.net()
    fp8.convert_to_float8(model, emulate=True)
    model.blocks[1].fc2.register_forward_pre_hook(_blow_up)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = dscale.StepGuard("cpu")
    numerics = fp8.Float8Numerics(model, guard, every=1)
    fallback = fp8.Float8Fallback(numerics, guard, threshold=0.05, samples=3)
    for step in range(5):
        tokens, target = _models.batch(step)
        guard.scale(_models.loss_of(model, tokens, target)).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
        if step == 0:
            numerics.close()
    assert numerics.num_samples == 1
    assert fallback.fallen == []
    assert fallback.runs["blocks.1.fc2"] == 1
    assert max(fallback.runs.values()) <= numerics.num_samples
    assert not numerics.sampled_last_step


def _overflow_run(overflow_at, scaler):
    """Fallback over ``samples=1``; an inf written into blocks.1.fc1's grad_output at
    ``overflow_at`` (a loss scale too high for one element, as fp16 overflows)."""
    model = _models.net()
    fp8.convert_to_float8(model, emulate=True)
    at = {"step": -1}

    def overflow(module, args, out):
        if at["step"] == overflow_at:

            def write_inf(grad):
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
                return grad

            out.register_hook(write_inf)

    model.blocks[1].fc1.register_forward_hook(overflow)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fallback = None
    if isinstance(scaler, dscale.GradScaler):
        numerics = fp8.Float8Numerics(model, scaler, every=1)
        fallback = fp8.Float8Fallback(numerics, scaler, threshold=0.05, samples=1)
    out = []
    for step in range(4):
        at["step"] = step
        tokens, target = _models.batch(step)
        scaler.scale(_models.loss_of(model, tokens, target)).backward()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped = scaler.get_scale() < scale
        out.append((skipped, list(fallback.fallen) if fallback else None))
    return out


def test_a_step_the_scaler_skips_for_an_overflow_switches_no_layer():
    """Review of issue 41 (item 9): the fallback decided on every sample, also a skipped step's:
    one inf in a grad_output (the loss scale too high for one element, which a dynamic scaler
    provokes by design) makes that tensor's scale 0, so its sample reads 'flushed' ~1.0, and with
    samples=1 the layer switched to high precision for good over a step that trained nothing.
    Oracle: torch's GradScaler skips that step too (the overflow is the scaler's business), and
    the same run without the overflow switches nothing; a skipped step neither extends nor ends
    a run."""
    torch_run = _overflow_run(2, torch.amp.GradScaler("cpu", init_scale=1024.0))
    assert [s for s, _ in torch_run] == [False, False, True, False]
    clean_run = _overflow_run(None, dscale.GradScaler("cpu", init_scale=1024.0))
    run = _overflow_run(2, dscale.GradScaler("cpu", init_scale=1024.0))
    assert [s for s, _ in run] == [s for s, _ in torch_run]
    assert [f for _, f in run] == [f for _, f in clean_run] == [[]] * 4
