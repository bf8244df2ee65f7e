"""PrecisionSchedule: an agreed per-layer precision map with switches at given steps.

Oracles: the uninterrupted run (a resume across a switch equals it bit for bit), torchao's own
float8 casts computed by hand (the forward-only variant's gradients), ``nn.functional.linear``
(its forward, and a layer switched to bf16).
"""

from __future__ import annotations

import logging

import pytest
import torch

import dscale
import dscale.fp8 as fp8
from dscale.precision import FORMATS, PrecisionSchedule
from tests.fp8 import _models
from tests.multirank import run_ranks
from tests.precision import _ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_ranks.scenarios, str(tmp_path_factory.mktemp("sched")), timeout_s=240.0)


def test_every_rank_switches_at_the_same_step_with_a_skip_in_between(ranks):
    """Both ranks run the schedule's map at every step; the skip (an inf on rank 1 only at step
    2) neither delays nor desyncs the switch at step 3: the step counts iterations."""
    whole = [ranks[r]["whole"] for r in (0, 1)]
    assert [w[2][1] for w in whole] == [False, False]  # step 2 skipped on both ranks
    assert [s[3] for s in whole[0]] == [s[3] for s in whole[1]]  # the same maps, step by step
    maps = [s[3] for s in whole[0]]
    assert maps[1] == _ranks.INITIAL  # after 2 steps: still the initial map
    assert maps[2]["blocks.0.fc1"] == "bf16_forward" and maps[2]["blocks.1.fc2"] == "tensorwise"
    assert maps[2]["blocks.1.fc2"] == "tensorwise" and maps[3]["blocks.1.fc2"] == "bf16"
    assert torch.equal(
        torch.cat([p.flatten() for p in ranks[0]["params"]]),
        torch.cat([p.flatten() for p in ranks[1]["params"]]),
    )
    assert ranks[0]["same_params_objects"] and ranks[0]["opt_state_kept"]


def test_a_resume_before_and_after_a_switch_equals_the_uninterrupted_run_bitwise(ranks):
    """Saved by dscale.checkpoint (the schedule travels with the scaler, unnamed) at step 2
    (before the skip and the first switch) and at step 4 (after both), resumed: losses, decisions,
    maps and every parameter equal the uninterrupted run bit for bit on both ranks."""
    for r in (0, 1):
        assert ranks[r]["resumed_at_2"] and ranks[r]["resumed_at_4"], r


def test_a_rank_local_edit_and_a_different_schedule_are_refused_on_every_rank(ranks):
    """A switch() on rank 1 alone is refused at the next step on both ranks (the fingerprint
    rides the scaler's vector); a schedule built differently is refused at construction."""
    for r in (0, 1):
        assert "precision maps differ" in ranks[r]["edit"], ranks[r]["edit"]
        assert "different schedules" in ranks[r]["other_schedule"], ranks[r]["other_schedule"]


def _cast(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's tensorwise dynamic cast by hand: scale = max(dtype) / amax (in fp32)."""
    amax = t.abs().max().to(torch.float64).clamp(min=1e-12)
    scale = (torch.finfo(dtype).max / amax).to(torch.float32)
    return (t * scale).clamp(torch.finfo(dtype).min, torch.finfo(dtype).max).to(dtype), scale


def test_the_forward_only_variant_runs_the_forward_in_high_precision_and_backward_in_fp8():
    """bf16_forward: output equals F.linear bitwise; grad_input and grad_weight equal the FP8
    GEMMs computed by hand (grad_output e5m2, weight and input e4m3, tensorwise scales)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48))
    sched = PrecisionSchedule(
        model, dscale.GradScaler("cpu"), initial={"0": "bf16_forward"}, emulate=True
    )
    layer = sched.module("0")
    x = torch.randn(64, 32, requires_grad=True)
    out = layer(x)
    go = torch.randn_like(out)
    out.backward(go)
    w = layer.weight.detach()
    assert torch.equal(out, torch.nn.functional.linear(x.detach(), w, layer.bias.detach()))
    go8, s_go = _cast(go, torch.float8_e5m2)
    w8, s_w = _cast(w, torch.float8_e4m3fn)
    x8, s_x = _cast(x.detach(), torch.float8_e4m3fn)
    grad_input = (go8.float() @ w8.float()) * (1 / s_go * (1 / s_w))
    grad_weight = (go8.float().t() @ x8.float()) * (1 / s_go * (1 / s_x))
    # Equal up to the order torchao applies the two inverse scales (a last-bit rounding).
    torch.testing.assert_close(x.grad, grad_input, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, grad_weight, rtol=1e-5, atol=1e-6)
    hp_grad = go @ w  # the high-precision grad_input differs far more: the backward is FP8
    assert (x.grad - hp_grad).abs().max() > 1000 * (x.grad - grad_input).abs().max()


def test_float8_fallback_switches_through_the_schedule():
    """Float8Fallback's switch of the troubled layer to bf16 is a schedule change: the map,
    the state and the module (computing as nn.Linear) show it."""
    model = _models.net()
    guard = dscale.StepGuard("cpu")
    names = [f"blocks.{b}.fc{i}" for b in (0, 1) for i in (1, 2)]
    sched = PrecisionSchedule(
        model, guard, initial=dict.fromkeys(names, "tensorwise"), emulate=True
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.blocks[1].fc2.register_forward_pre_hook(_blow_up)
    numerics = fp8.Float8Numerics(model, guard, every=1)
    fallback = fp8.Float8Fallback(numerics, guard, threshold=0.05, samples=2)
    for step in range(4):
        tokens, target = _models.batch(step)
        guard.scale(_models.loss_of(model, tokens, target)).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
    assert fallback.fallen == ["blocks.1.fc2"]
    assert sched.formats["blocks.1.fc2"] == "bf16"
    assert sched.state_dict()["layers"]["blocks.1.fc2"].item() == FORMATS.index("bf16")
    layer = sched.module("blocks.1.fc2")
    x = torch.randn(4, 64)
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert torch.equal(layer.forward(x), ref)  # (forward: the outlier hook is still on it)


def _blow_up(module, args):
    bump = torch.zeros_like(args[0])
    bump.view(-1)[0] = args[0].detach().abs().max() * 1e4
    return (args[0] + bump,)


def test_bad_names_formats_and_steps_are_refused_naming_them():
    model = _models.net()
    scaler = dscale.GradScaler("cpu")
    with pytest.raises(
        ValueError, match=r"'blocks.0.fc3'.*nearest linears \['blocks.0.fc2', 'blocks.0.fc1'"
    ):
        PrecisionSchedule(model, scaler, initial={"blocks.0.fc3": "bf16"})
    with pytest.raises(ValueError, match="'fp4' is not a precision format"):
        PrecisionSchedule(model, scaler, initial={"blocks.0.fc1": "fp4"})
    with pytest.raises(ValueError, match="needs its format at step 0 in initial"):
        PrecisionSchedule(
            model, scaler, initial={"blocks.0.fc1": "bf16"}, switches={3: {"head": "bf16"}}
        )
    with pytest.raises(ValueError, match="must be a positive int"):
        PrecisionSchedule(
            model, scaler, initial={"blocks.0.fc1": "bf16"}, switches={0: {"blocks.0.fc1": "bf16"}}
        )
    assert type(model.blocks[0].fc1) is torch.nn.Linear  # nothing converted


def test_a_switch_is_logged_in_one_line_and_served(caplog):
    """One log line names the layers and formats; the exporter's collector serves each
    layer's current format."""
    from prometheus_client import CollectorRegistry, generate_latest

    from dscale.fp8._collector import AttachedFloat8Collector

    model = _models.net()
    scaler = dscale.GradScaler("cpu")
    sched = PrecisionSchedule(model, scaler, initial={"blocks.0.fc1": "tensorwise"}, emulate=True)
    registry = CollectorRegistry()
    registry.register(AttachedFloat8Collector(scaler, {"rank": "0"}))
    with caplog.at_level(logging.WARNING, logger="dscale.precision._schedule"):
        sched.switch({"blocks.0.fc1": "bf16"})
    assert [r.getMessage() for r in caplog.records] == [
        "PrecisionSchedule: step 0: blocks.0.fc1 tensorwise -> bf16"
    ]
    text = generate_latest(registry).decode()
    assert 'dscale_precision_format{format="bf16",layer="blocks.0.fc1",rank="0"} 1.0' in text


def test_a_state_for_other_layers_or_formats_is_refused_and_changes_nothing():
    """load_state_dict validates fully first: another layer set, an unknown format index or
    another version is a ValueError naming it, and the step and map stay as they were."""
    model = _models.net()
    scaler = dscale.GradScaler("cpu")
    sched = PrecisionSchedule(model, scaler, initial={"blocks.0.fc1": "bf16", "head": "bf16"})
    good = sched.state_dict()
    assert set(good["layers"]) == {"blocks.0.fc1", "head"}
    other = {
        **good,
        "layers": {"blocks.0.fc2": good["layers"]["head"], "head": good["layers"]["head"]},
    }
    with pytest.raises(ValueError, match=r"not in this model: \['blocks.0.fc2'\]"):
        sched.load_state_dict(other)
    bad_format = {**good, "layers": {**good["layers"], "head": torch.tensor([99])}}
    with pytest.raises(ValueError, match="format index 99"):
        sched.load_state_dict(bad_format)
    with pytest.raises(ValueError, match="format version 7"):
        sched.load_state_dict({**good, "version": torch.tensor(7)})
    assert sched.step == 0 and sched.formats == {"blocks.0.fc1": "bf16", "head": "bf16"}
    sched.load_state_dict({**good, "step": torch.tensor(5)})
    assert sched.step == 5


def test_a_linear_subclass_is_refused_as_convert_to_float8_leaves_it():
    """A user's nn.Linear subclass with its own forward (here: the output doubled). Oracle:
    convert_to_float8 leaves it ("a subclass of nn.Linear"); the schedule swapped it for a
    Float8Linear holding its parameters, dropping its forward silently (the model's output
    halved) (r43n). Now: a ValueError naming the layer and its class, the model unchanged."""

    class Doubled(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(Doubled(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))

    left = fp8.convert_to_float8(model(), emulate=True).left
    assert "subclass of nn.Linear" in left["0"]
    net = model()
    x = torch.randn(32, 64)
    before = net(x)
    with pytest.raises(ValueError, match=r"'0' \(a Doubled, a subclass of nn.Linear"):
        PrecisionSchedule(net, dscale.StepGuard("cpu"), initial={"0": "tensorwise"}, emulate=True)
    assert type(net[0]) is Doubled and torch.equal(net(x), before)
    for fmt in ("bf16", "mxfp8"):  # refused whatever the format (the schedule swaps it)
        with pytest.raises(ValueError, match=r"subclass of nn\.Linear"):
            PrecisionSchedule(net, dscale.StepGuard("cpu"), initial={"0": fmt}, emulate=True)
    PrecisionSchedule(net, dscale.StepGuard("cpu"), initial={"2": "tensorwise"}, emulate=True)
