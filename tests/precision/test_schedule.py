"""PrecisionSchedule: an agreed per-layer precision map with switches at given steps.

Oracles: the uninterrupted run (a resume across a switch equals it bit for bit), torchao's own
float8 casts computed by hand (the forward-only variant's gradients), ``nn.functional.linear``
(its forward, and a layer switched to bf16).
"""

from __future__ import annotations

import logging
from typing import Any

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


def test_a_rank_whose_schedule_is_at_another_step_is_refused_on_every_rank(ranks):
    """Rank 1's schedule loaded at step 3, rank 0's at 0, the same map and nothing to switch:
    the ranks' steps differ, which the fingerprint did not cover (not refused: the ranks would
    take the next switch at different iterations). With check_every=4 the ranks compared at
    different iterations (each by its own step), so their vectors had different lengths and
    gloo aborted both processes; now both compare at the scaler's iterations and refuse."""
    for r in (0, 1):
        for every in (1, 4):
            got = ranks[r][f"other_step_every_{every}"]
            assert "precision maps differ" in got and "step" in got, (r, every, got)


def test_a_rank_local_edit_runs_at_most_check_every_iterations_before_the_refusal(ranks):
    """check_every=4 and switch() on rank 1 after iteration 0: iterations 1-3 complete with the
    maps differing, iteration 4 (the next compared one) is refused on both ranks, as the docs
    say ("up to check_every iterations")."""
    for r in (0, 1):
        ran, message = ranks[r]["edit_every_4"]
        assert ran == 3 and "at step 4" in message, (r, ran, message)


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


def _fallback_run(steps: int) -> tuple[PrecisionSchedule, fp8.Float8Fallback, list[float], Any]:
    """A schedule that switches blocks.1.fc2 to rowwise at step 4, and a Float8Fallback that
    switches the same layer to bf16 at step 2 (an outlier on its input)."""
    model = _models.net()
    guard = dscale.StepGuard("cpu")
    names = [f"blocks.{b}.fc{i}" for b in (0, 1) for i in (1, 2)]
    sched = PrecisionSchedule(
        model,
        guard,
        initial=dict.fromkeys(names, "tensorwise"),
        switches={4: {"blocks.1.fc2": "rowwise"}},
        emulate=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.blocks[1].fc2.register_forward_pre_hook(_blow_up)
    numerics = fp8.Float8Numerics(model, guard, every=1)
    fallback = fp8.Float8Fallback(numerics, guard, threshold=0.05, samples=2)
    losses = []
    for step in range(steps):
        tokens, target = _models.batch(step)
        loss = _models.loss_of(model, tokens, target)
        guard.scale(loss).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
        losses.append(loss.item())
    return sched, fallback, losses, guard


def test_a_layer_float8fallback_switched_stays_in_bf16_through_a_later_switch_and_a_resume(caplog):
    """Float8Fallback switches blocks.1.fc2 to bf16 at step 2; the schedule would switch it to
    rowwise at step 4. The fallback wins (the layer was measured unfit for FP8), on every rank
    alike (both decisions are agreed), with a log line; and a resume at step 6 (the schedule's
    state, then the fallback's, as dscale.checkpoint loads them) has the uninterrupted run's
    map. Before: the schedule switched the layer back to rowwise, and the resume's fallback
    load switched it to bf16 again: the resumed run trained another format than the
    uninterrupted one."""
    from dscale.fp8 import _attached

    with caplog.at_level(logging.WARNING, logger="dscale.precision._schedule"):
        whole, fallback, _, guard = _fallback_run(6)
    assert fallback.fallen == ["blocks.1.fc2"]
    assert whole.formats["blocks.1.fc2"] == "bf16"
    assert any(
        "Float8Fallback" in r.getMessage() and "step 4" in r.getMessage() for r in caplog.records
    )
    saved = {k: v.state_dict() for k, v in _attached.companions(guard).items()}
    resumed, _, _, guard2 = _fallback_run(0)
    for key, companion in _attached.companions(guard2).items():
        companion.load_state_dict(saved[key])
    assert resumed.formats == whole.formats and resumed.step == whole.step


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
    caplog.clear()  # the construction's own line (INFO) shows where another test lowered the level
    with caplog.at_level(logging.WARNING, logger="dscale.precision._schedule"):
        sched.switch({"blocks.0.fc1": "bf16"})
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
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


def _one_step(model, opt, scaler):
    tokens, target = _models.batch(0, size=4)
    scaler.scale(_models.loss_of(model, tokens, target)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def test_a_checkpoint_with_a_schedule_into_a_run_without_one_is_refused_and_changes_nothing(
    tmp_path,
):
    """A run with blocks.1.fc2 in mxfp8 is saved; a run without a schedule (every layer in
    the model's own format) loads it with its scaler: refused, naming precision_schedule and the
    fix, and the model and scaler stay as they were. Before: it loaded, and the resumed run
    trained blocks.1.fc2 as nn.Linear, not the saved run's format, without a word. Loaded
    without the scaler (the weights only), it still loads."""
    from dscale.checkpoint import CheckpointError, CheckpointManager, load_checkpoint

    model = _models.net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = dscale.StepGuard("cpu")
    sched = PrecisionSchedule(model, scaler, initial={"blocks.1.fc2": "mxfp8"}, emulate=True)
    _one_step(model, opt, scaler)
    manager = CheckpointManager(tmp_path, every=0, keep=1)
    manager.save(1, model=model, optimizer=opt, scaler=scaler)
    manager.wait()
    sched.close()
    plain = _models.net(seed=1)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain_scaler = dscale.StepGuard("cpu")
    _one_step(plain, plain_opt, plain_scaler)
    before = [p.detach().clone() for p in plain.parameters()]
    scaler_before = plain_scaler.state_dict()
    with pytest.raises(CheckpointError, match=r"precision_schedule.*PrecisionSchedule"):
        load_checkpoint(tmp_path / "step-1", model=plain, optimizer=plain_opt, scaler=plain_scaler)
    assert all(torch.equal(a, b) for a, b in zip(before, plain.parameters()))
    assert plain_scaler.state_dict() == scaler_before
    assert load_checkpoint(tmp_path / "step-1", model=plain, optimizer=plain_opt) == 1


def test_a_checkpoint_without_a_schedule_into_a_run_with_one_is_refused_and_changes_nothing(
    tmp_path,
):
    """A run without a schedule is saved; a fresh run with one (its optimizer not stepped yet)
    loads it: refused, naming precision_schedule, and the model, the map and the optimizer stay
    as they were. Before: the optimizer did not: to learn its structure, DCP stepped the fresh
    AdamW with zero grads and lr 0, and the refusal left that state (step 1, zero moments), so
    a run that went on would apply Adam's bias correction one step off."""
    from dscale.checkpoint import CheckpointError, CheckpointManager, load_checkpoint

    model = _models.net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = dscale.StepGuard("cpu")
    _one_step(model, opt, scaler)
    manager = CheckpointManager(tmp_path, every=0, keep=1)
    manager.save(1, model=model, optimizer=opt, scaler=scaler)
    manager.wait()
    fresh = _models.net(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_scaler = dscale.StepGuard("cpu")
    sched = PrecisionSchedule(fresh, fresh_scaler, initial={"blocks.1.fc2": "mxfp8"}, emulate=True)
    before = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(CheckpointError, match="holds no precision_schedule state"):
        load_checkpoint(tmp_path / "step-1", model=fresh, optimizer=fresh_opt, scaler=fresh_scaler)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))
    assert sched.formats == {"blocks.1.fc2": "mxfp8"} and sched.step == 0
    assert not fresh_opt.state, "a refused load left optimizer state behind"
    assert all(p.grad is None for p in fresh.parameters())


def test_adam_state_and_weights_through_switches_equal_torchao_modules_swapped_by_hand():
    """blocks.0.fc1 tensorwise -> mxfp8 at step 2 -> bf16_forward at step 3 -> tensorwise at
    step 4, under AdamW with weight decay and a frozen bias in the switched layer: the losses,
    every weight and Adam's moments equal a run that swaps torchao's own modules by hand
    (Float8Linear.from_float, MXFP8Linear emulated, holding the same parameters) at the same
    steps, bit for bit."""
    import dataclasses

    from torchao.float8 import CastConfig, Float8LinearConfig, ScalingType
    from torchao.float8.float8_linear import Float8Linear
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    tensorwise = dataclasses.replace(
        Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True
    )
    off = CastConfig(scaling_type=ScalingType.DISABLED)
    forward_off = dataclasses.replace(tensorwise, cast_config_input=off, cast_config_weight=off)

    def by_hand(old, fmt):
        if fmt == "mxfp8":
            new = MXFP8Linear(
                old.in_features,
                old.out_features,
                bias=True,
                kernel_preference=KernelPreference.EMULATED,
                scale_calculation_mode=ScaleCalculationMode.RCEIL,
            )
        else:
            plain = torch.nn.Linear(old.in_features, old.out_features)
            plain.weight, plain.bias = old.weight, old.bias
            config = tensorwise if fmt == "tensorwise" else forward_off
            return Float8Linear.from_float(plain, config=config)
        new.weight, new.bias = old.weight, old.bias
        return new

    plan = {2: "mxfp8", 3: "bf16_forward", 4: "tensorwise"}
    runs = []
    for hand in (False, True):
        model = _models.net()
        model.blocks[0].fc1.bias.requires_grad_(False)
        opt = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1
        )
        guard = dscale.StepGuard("cpu")
        if hand:
            model.blocks[0].fc1 = by_hand(model.blocks[0].fc1, "tensorwise")
        else:
            sched = PrecisionSchedule(
                model,
                guard,
                initial={"blocks.0.fc1": "tensorwise"},
                switches={s: {"blocks.0.fc1": f} for s, f in plan.items()},
                emulate=True,
            )
        losses = []
        for step in range(5):
            if hand and step in plan:
                model.blocks[0].fc1 = by_hand(model.blocks[0].fc1, plan[step])
            tokens, target = _models.batch(step, size=4)
            loss = _models.loss_of(model, tokens, target)
            guard.scale(loss).backward()
            guard.step(opt)
            guard.update()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, [p.detach().clone() for p in model.parameters()], opt.state_dict()))
        if not hand:
            assert sched.formats == {"blocks.0.fc1": "tensorwise"}
            sched.close()
    (losses, params, state), (losses_h, params_h, state_h) = runs
    assert losses == losses_h
    assert all(torch.equal(a, b) for a, b in zip(params, params_h))
    for index, moments in state["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[key], state_h["state"][index][key]), (index, key)


def test_a_fullgraph_compiled_step_with_a_schedule_is_refused_naming_the_schedule():
    """torch.compile(fullgraph=True) around step()/update() of a sync_free scaler with a
    schedule: refused (the schedule counts steps in a step callback), and the reason names the
    PrecisionSchedule. Before: it named only register_step_callback and said to read
    step_applied() outside the region, which the user, who registered nothing, cannot act on.
    (Without fullgraph the step runs eagerly and the schedule switches: checked by hand.)"""
    model = _models.net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    scaler = dscale.StepGuard("cpu", sync_free=True)
    sched = PrecisionSchedule(model, scaler, initial={"blocks.0.fc1": "tensorwise"}, emulate=True)

    @torch.compile(backend="eager", fullgraph=True)
    def update():
        scaler.step(opt)
        scaler.update()

    for step in range(2):
        tokens, target = _models.batch(step, size=4)
        scaler.scale(_models.loss_of(model, tokens, target)).backward()
        if step == 0:
            scaler.step(opt)  # eager warm-up: the optimizer's state
            scaler.update()
        else:
            with pytest.raises(Exception, match="PrecisionSchedule"):
                update()
        opt.zero_grad()
    sched.close()
    torch._dynamo.reset()


def test_a_swap_that_float8numerics_stops_seeing_is_logged(caplog):
    """blocks.0.fc1 measured by Float8Numerics (tensorwise) switches to mxfp8 at step 1: a new
    module, which the numerics' hooks are not on. From then on the numerics report zeros for
    the layer (amax 0); a warning names the layer. Before: nothing said so (listed as not done,
    but silent at run time)."""
    model = _models.net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = dscale.StepGuard("cpu")
    names = [f"blocks.{b}.fc{i}" for b in (0, 1) for i in (1, 2)]
    sched = PrecisionSchedule(
        model,
        guard,
        initial=dict.fromkeys(names, "tensorwise"),
        switches={1: {"blocks.0.fc1": "mxfp8"}},
        emulate=True,
    )
    numerics = fp8.Float8Numerics(model, guard, every=1)
    with caplog.at_level(logging.WARNING, logger="dscale.precision._schedule"):
        for step in range(2):
            _one_step_at(model, opt, guard, step)
    assert numerics.snapshot()["blocks.0.fc1/input"]["amax"] == 0.0  # what it reports now
    assert numerics.snapshot()["blocks.1.fc1/input"]["amax"] > 0.0
    warned = [r.getMessage() for r in caplog.records if "Float8Numerics" in r.getMessage()]
    assert len(warned) == 1 and "blocks.0.fc1 now runs in mxfp8" in warned[0], warned
    numerics.close()
    sched.close()


def _one_step_at(model, opt, scaler, step):
    tokens, target = _models.batch(step, size=4)
    scaler.scale(_models.loss_of(model, tokens, target)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def test_layers_torchao_cannot_take_in_a_format_are_refused_before_anything_runs():
    """The schedule asks for a format explicitly, so a layer convert_to_float8 would leave is a
    ValueError at construction naming the layer, its dims or type and the format, and nothing is
    converted: head (32 -> 10) in mxfp8 (32-blocks) or, by a switch at step 900, in tensorwise
    (torch._scaled_mm's 16); MultiheadAttention's out_proj (an nn.Linear subclass whose forward
    MHA never calls: the layer would have stayed in high precision while the map said
    tensorwise); a linear held under two names (the swap would replace one). Before: the mxfp8
    head was accepted and the first forward raised torchao's AssertionError ('the last dimension
    of shape torch.Size([64, 10]) must be divisible by block_size 32'), at step 900 for a
    scheduled switch; the others were accepted and ran silently in another format."""
    model = _models.net()
    scaler = dscale.StepGuard("cpu")
    with pytest.raises(ValueError, match=r"head.*in_features=32, out_features=10.*mxfp8.*32"):
        PrecisionSchedule(model, scaler, initial={"head": "mxfp8"}, emulate=True)
    with pytest.raises(ValueError, match=r"switches\[900\].*head.*tensorwise.*16"):
        PrecisionSchedule(
            model,
            scaler,
            initial={"head": "bf16"},
            switches={900: {"head": "tensorwise"}},
            emulate=True,
        )
    assert type(model.head) is torch.nn.Linear
    sched = PrecisionSchedule(model, scaler, initial={"head": "bf16"}, emulate=True)
    with pytest.raises(ValueError, match=r"switch\(\).*head.*mxfp8.*32"):
        sched.switch({"head": "mxfp8"})  # at run time, as Float8Fallback's switch() call
    assert type(model.head) is torch.nn.Linear and sched.formats == {"head": "bf16"}
    sched.close()
    attention = torch.nn.Sequential(torch.nn.MultiheadAttention(32, 2))
    with pytest.raises(ValueError, match=r"0.out_proj.*NonDynamicallyQuantizableLinear"):
        PrecisionSchedule(attention, scaler, initial={"0.out_proj": "tensorwise"}, emulate=True)
    model.shared = model.blocks[0].fc1
    with pytest.raises(ValueError, match=r"blocks.0.fc1.*also held as \['shared'\]"):
        PrecisionSchedule(model, scaler, initial={"blocks.0.fc1": "tensorwise"}, emulate=True)
    assert type(model.blocks[0].fc1) is torch.nn.Linear


def test_a_disabled_scaler_is_refused_instead_of_never_switching():
    """torch's AMP idiom GradScaler(enabled=use_amp) with use_amp False (and a disabled
    StepGuard): a disabled scaler's step() calls no step callbacks and runs no collective, so
    the schedule never counted a step: after 4 steps its step was 0 and blocks.0.fc1 still
    tensorwise, where the switch was at 2, and no rank was ever compared. Now a ValueError
    naming enabled=False and StepGuard, and nothing is converted (on 2 ranks, a scaler disabled
    on one rank only is refused on both: tests/precision/_ranks.py)."""
    for scaler in (dscale.GradScaler("cpu", enabled=False), dscale.StepGuard("cpu", enabled=False)):
        model = _models.net()
        with pytest.raises(ValueError, match=r"enabled=False.*StepGuard"):
            PrecisionSchedule(
                model,
                scaler,
                initial={"blocks.0.fc1": "tensorwise"},
                switches={2: {"blocks.0.fc1": "bf16"}},
                emulate=True,
            )
        assert type(model.blocks[0].fc1) is torch.nn.Linear


def test_a_scaler_disabled_on_one_rank_only_is_refused_on_every_rank(ranks):
    for r in (0, 1):
        assert "scaler enabled" in ranks[r]["disabled_on_rank_1"], ranks[r]["disabled_on_rank_1"]


def test_fp16_autocast_two_optimizers_clipping_and_a_skip_at_the_switch_equal_torchs_scaler():
    """fp16 autocast, two optimizers (AdamW on the blocks, SGD on the rest), unscale_() and
    clip_grad_norm_ every step, an inf in the iteration whose step triggers the switch (step 2:
    skipped, the scale backed off, the switch still at step 2): the losses, scales and weights
    equal torch's GradScaler with the same modules switched by hand after that iteration, bit
    for bit (passes on p43c: an attack that found nothing)."""
    switches = {2: {"blocks.0.fc1": "bf16", "blocks.1.fc2": "bf16_forward"}}
    initial = {"blocks.0.fc1": "tensorwise", "blocks.1.fc2": "rowwise"}
    runs = []
    for oracle in (False, True):
        model = _models.net()
        opts = [
            torch.optim.AdamW(model.blocks.parameters(), lr=1e-2),
            torch.optim.SGD([*model.embed.parameters(), *model.head.parameters()], lr=1e-2),
        ]
        if oracle:
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
            by_hand = PrecisionSchedule(
                model, dscale.StepGuard("cpu"), initial=initial, emulate=True
            )
            by_hand.close()  # the modules only: switched by hand below
        else:
            scaler = dscale.GradScaler("cpu", init_scale=2.0**16)
            sched = PrecisionSchedule(
                model, scaler, initial=initial, switches=switches, emulate=True
            )
        out = []
        for step in range(3):
            tokens, target = _models.batch(step, size=4)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _models.loss_of(model, tokens, target)
            scaler.scale(loss).backward()
            if step == 1:
                model.head.weight.grad.view(-1)[0] = float("inf")
            for opt in opts:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for opt in opts:
                scaler.step(opt)
            scaler.update()
            for opt in opts:
                opt.zero_grad()
            if oracle and step + 1 in switches:
                by_hand.switch(switches[step + 1])
            out.append((loss.item(), scaler.get_scale()))
        runs.append((out, [p.detach().clone() for p in model.parameters()]))
        if not oracle:
            assert sched.formats == {**initial, **switches[2]} and sched.step == 3
            sched.close()
    (got, params), (want, params_want) = runs
    assert got == want and got[1][1] == got[0][1] / 2  # the skip backed the scale off
    assert all(torch.equal(a, b) for a, b in zip(params, params_want))


def test_a_bad_layer_name_on_one_rank_only_is_refused_on_every_rank(ranks):
    """Rank 1's initial names blocks.0.fc3 (no such layer), rank 0's a good one: a ValueError on
    both ranks naming rank 1 and the layer. Before: rank 1 raised alone and rank 0 waited in the
    construction's all-gather until the process group's timeout."""
    for r in (0, 1):
        got = ranks[r]["bad_name_on_rank_1"]
        assert got.startswith("PrecisionSchedule failed on rank(s) 1") and "fc3" in got, (r, got)
