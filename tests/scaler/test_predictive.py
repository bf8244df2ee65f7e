"""policy="predictive": the target against brute force, host == device, real fp16 gradients."""

from __future__ import annotations

import copy
import logging
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dscale
from dscale.scaler._program import predictive as _predictive
from dscale.scaler._program import scale_rule as _policy
from dscale.scaler._program.scale_rule import HostState, ScalePolicy
from dscale.scaler._state import predictive as _predictive_state
from dscale.scaler._state.book import ScaleState
from dscale.scaler._state.predictive import PredictiveScaling
from tests.scaler._setup import decide_on_device


def _brute_force_target(window_max: float) -> float:
    """The largest 2**t with window_max * 2**t <= BUDGET (65504 / the margin, in float32), by
    trying every t (exact)."""
    best = 2.0**-100
    for t in range(-100, 101):
        if window_max * 2.0**t <= _predictive.BUDGET:
            best = 2.0**t
    return best


def _f32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def test_target_is_the_largest_power_of_two_keeping_the_window_max_with_its_margin() -> None:
    rng = random.Random(0)
    top = _predictive.BUDGET / 2**16
    values = [2.0**e for e in range(-30, 20)]
    values += [top * 2.0**e for e in range(-20, 5)]  # the boundary itself
    values += [math.nextafter(top, 1.0) * 2.0**e for e in range(-20, 5)]  # just above it
    values += [math.nextafter(top, 0.0) * 2.0**e for e in range(-20, 5)]  # just below it
    values += [rng.uniform(1e-9, 1e3) for _ in range(300)]
    policy = ScalePolicy(2.0, 0.5, 2000, None, None, 1, "on_growth")
    for m in values:
        m = _f32(m)  # the window holds fp32 values
        assert _predictive.target_scale(policy, m) == _brute_force_target(m), m
        # The device form: the same bits.
        rings = torch.tensor([_predictive.FLOOR, 0.0, 0.0, 0.0])  # floor, memory, window (2)
        scale = torch.tensor(1.0)
        budget = torch.tensor(_predictive.BUDGET)
        zero, measured = torch.tensor(0.0), torch.tensor(m)
        memory, window = rings[1:2], rings[2:]
        asked = torch.tensor(0.0)
        _predictive.update_(
            policy, rings, window, memory, (0, 0), scale, None, zero, measured, budget, asked
        )
        assert asked.item() == m  # what the step asked for, kept for telemetry
        assert scale.item() == _brute_force_target(m), m


def _policy_matrix() -> list[ScalePolicy]:
    out = []
    for interval in (1, 3, 2000):
        for lo, hi in ((None, None), (2.0**4, 2.0**12), (0.75, None)):
            for hyst in (1, 2):
                for backoff in (0.5, 0.25):
                    out.append(ScalePolicy(2.0, backoff, interval, lo, hi, hyst, "on_growth"))
    return out


def test_host_and_device_rules_agree_bit_for_bit_over_long_runs() -> None:
    """Every policy, random runs of overflows, spikes and zero steps: host == device each step."""
    rng = random.Random(1)
    magnitudes = [0.0, 2.0**-40, 1e-7, 3e-4, 0.01, 0.5, 1.0, 65504.0 / 2**17, 7.0, 1e5]
    for policy in _policy_matrix():
        window, memory = rng.choice([1, 3, 8]), rng.choice([1, 5, 12])
        first = _f32(min(max(1.0, policy.min_scale or 0.0), policy.max_scale or math.inf))
        start = HostState(first, 0, policy.hysteresis, (0,) * _policy.NUM_COUNTERS)
        tail = _predictive_state.tail_words(window, memory)
        host_book, device_book = ScaleState(start, tail), ScaleState(start, tail)
        host_p = PredictiveScaling(window, memory)
        device_p = PredictiveScaling(window, memory)
        host_book.place(torch.device("cpu"))
        device_book.place(torch.device("cpu"))
        for step in range(40):
            found = rng.random() < 0.2
            scale = host_book.read().scale
            m = _f32(rng.choice(magnitudes) * rng.uniform(0.5, 2.0) * scale)
            if found and rng.random() < 0.7:  # a rank's overflow shows in the measurement
                m = _predictive.OVERFLOW_MARK
            vector = torch.tensor([float(found), m, 0.0])
            host_p.begin([vector], [vector.tolist()], 1)
            host_book.update(policy, torch.tensor(float(found)), found, host_p)
            device_p.begin([vector.clone()], None, 1)
            device_book.update(policy, torch.tensor(float(found)), None, device_p)
            h, d = host_book.read(), device_book.read()
            case = (policy, window, step, found, m)
            assert (h.scale, h.counters) == (d.scale, d.counters), case
            assert (h.growth_tracker, h.hysteresis_tracker) == (
                d.growth_tracker,
                d.hysteresis_tracker,
            ), case
            assert host_p.rings() == device_p.rings(), case


def _reference_rule(window: int, memory: int):
    """policy="predictive" written out from its definition, for the scaler to be held to."""
    entries: list[float] = []
    overflows: list[float] = []

    def next_scale(scale: float, overflowed: bool, largest: float) -> float:
        budget = _predictive.BUDGET
        entry = 65504.0 / scale if overflowed else largest if largest > 0 else budget / scale
        entries.append(entry)  # nothing measured asks for the scale it has
        overflows.append(entry if overflowed else 0.0)
        return _brute_force_target(max(entries[-window:] + overflows[-memory:]))

    return next_scale


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16)]
    return nn.Sequential(*layers)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 32, generator=g) * 4
    y = torch.randint(16, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return F.cross_entropy(out.float(), y)


def _largest_safe_scale(model: nn.Module, loss: torch.Tensor) -> float:
    """Brute force: the largest power-of-two scale whose fp16 backward has no inf/NaN."""
    params = list(model.parameters())
    best = 0.0
    for e in range(0, 41):
        grads = torch.autograd.grad(loss * 2.0**e, params, retain_graph=True)
        if all(torch.isfinite(g).all() for g in grads):
            best = 2.0**e
    return best


@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**32])
def test_predictive_scale_stays_below_and_near_the_largest_safe_scale(init_scale) -> None:
    model = _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = dscale.GradScaler("cpu", init_scale=init_scale, policy="predictive")
    assert scaler.get_scale() == 1.0  # the first step measures at a scale that cannot overflow
    ratios = []
    for step in range(12):
        loss = _loss(model, step)
        safe = _largest_safe_scale(model, loss)
        used = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert scaler.step_applied(), step
        assert used <= safe, (step, used, safe)
        ratios.append(safe / used)
    # From the step after the first measurement on: at most 4x below the largest safe scale
    # (the margin of 2, and the window's memory of the larger grads of the first steps).
    assert max(ratios[1:]) <= 4.0, ratios
    # Negative control: the dynamic rule from 2**32 skips steps while it searches.
    model = _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dynamic = dscale.GradScaler("cpu", init_scale=init_scale)
    for step in range(12):
        dynamic.scale(_loss(model, step)).backward()
        dynamic.step(opt)
        dynamic.update()
        opt.zero_grad()
    assert dynamic.snapshot()["skipped_steps"] >= (5 if init_scale == 2.0**32 else 0)


def _run(scaler: dscale.GradScaler, opt_name: str, steps: int, poison: set[int]) -> list[float]:
    model = _mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, fused=opt_name == "sgd-fused")
    scales = []
    for step in range(steps):
        scaler.scale(_loss(model, step) * (30.0 if step in (6, 7) else 1.0)).backward()
        if step in poison:
            next(model.parameters()).grad.view(-1)[0] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def test_plain_fused_and_sync_free_steps_follow_the_same_scale_trajectory() -> None:
    kwargs = {"init_scale": 2.0**20, "policy": "predictive", "growth_interval": 3}
    poison = {3, 9}
    plain = _run(dscale.GradScaler("cpu", **kwargs), "sgd", 14, poison)
    # The device-side decisions (the CUDA path), forced on the CPU.
    free = _run(
        decide_on_device(dscale.GradScaler("cpu", sync_free=True, **kwargs)), "sgd", 14, poison
    )
    assert plain == free
    fused = decide_on_device(dscale.GradScaler("cpu", **kwargs))
    assert plain == _run(fused, "sgd-fused", 14, poison)
    assert plain == _run(dscale.GradScaler("cpu", **kwargs), "sgd-fused", 14, poison)
    assert len(set(plain)) > 3  # the scale moved: jumped, dropped for the x30 loss, backed off


def test_training_follows_the_rule_as_written_from_its_definition() -> None:
    """The oracle: the window rule computed in the test from the grads each step leaves."""
    window, memory = 5, 9
    scaler = dscale.GradScaler(
        "cpu", policy="predictive", predictive_window=window, growth_interval=memory
    )
    reference = _reference_rule(window, memory)
    model = _mlp(9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    expected = scaler.get_scale()
    for step in range(30):
        weight = {4: 30.0, 11: 0.0, 12: 0.0, 20: 8.0}.get(step, 1.0)  # spikes and zero steps
        scale = scaler.get_scale()
        assert scale == expected, step
        scaler.scale(_loss(model, step) * weight).backward()
        if step in (7, 15):
            next(model.parameters()).grad.view(-1)[0] = math.inf
        grads = [p.grad for p in model.parameters()]
        overflowed = not all(bool(torch.isfinite(g).all()) for g in grads)
        largest = max(_f32(float(g.abs().max()) / scale) for g in grads) if not overflowed else 0
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        expected = reference(scale, overflowed, largest)
    assert scaler.get_scale() == expected
    assert scaler.snapshot()["skipped_steps"] >= 2


def test_an_overflow_backs_off_and_is_remembered_for_growth_interval_steps() -> None:
    window = 6  # growth_interval: as long as the dynamic rule stays backed off
    scaler = dscale.GradScaler(
        "cpu", policy="predictive", predictive_window=2, growth_interval=window
    )
    model = _mlp(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the same grads every step
    scales = []
    for step in range(3 + window + 1):
        scaler.scale(_loss(model, 0)).backward()
        if step == 2:
            next(model.parameters()).grad.view(-1)[0] = math.nan
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    steady = scales[1]
    assert scales[:2] == [steady, steady]
    assert not math.isnan(steady) and scales[2] == steady / 2  # torch's back-off
    assert scales[2 : 2 + window] == [steady / 2] * window  # remembered for the window
    assert scales[2 + window] == steady  # then forgotten
    snap = scaler.snapshot()
    assert (snap["skipped_steps"], snap["backoffs"], snap["growths"]) == (1, 1, 2)


def test_min_max_scale_and_hysteresis_hold_under_the_predictive_policy(caplog) -> None:
    scaler = dscale.GradScaler(
        "cpu", policy="predictive", init_scale=4.0, min_scale=2.0, max_scale=2.0**10
    )
    assert scaler.get_scale() == 2.0  # the first scale is clamped into [min, max]
    model = _mlp(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler.scale(_loss(model, 0)).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**10  # the target (far above) clamped to max_scale
    hyst = dscale.GradScaler("cpu", policy="predictive", hysteresis=2)
    stuck = dscale.GradScaler(
        "cpu", policy="predictive", min_scale=1.0, on_stuck_at_min="raise", stuck_patience=2
    )
    for step in range(3):
        for s in (hyst, stuck) if step < 2 else (hyst,):
            s.scale(_loss(model, step)).backward()
            next(model.parameters()).grad.view(-1)[0] = math.inf
            s.step(opt)
            opt.zero_grad()
            if s is hyst or step == 0:
                s.update()
                continue
            with pytest.raises(dscale.ScaleCollapsedError, match="min_scale=1"):
                s.update()  # the second overflow in a row at min_scale (stuck_patience=2)
        if step == 0:
            assert hyst.get_scale() == 1.0  # the first overflow is tolerated (hysteresis=2)
    assert hyst.snapshot()["backoffs"] == 2


@pytest.mark.parametrize("window", [0, -3, 2.5, "8", True])
def test_a_bad_predictive_window_is_a_value_error_naming_it(window) -> None:
    with pytest.raises(ValueError, match=r"predictive_window must be an int >= 1, got"):
        dscale.GradScaler("cpu", policy="predictive", predictive_window=window)


def test_bad_policy_is_a_value_error_listing_both() -> None:
    with pytest.raises(ValueError, match=r"policy must be one of \('dynamic', 'predictive'\)"):
        dscale.GradScaler("cpu", policy="adaptive")  # type: ignore[arg-type]


def test_dynamic_policy_matches_torch_scaler_bit_for_bit() -> None:
    def trace(scaler) -> list[float]:
        model = _mlp(4)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        out = []
        for step in range(10):
            scaler.scale(_loss(model, step)).backward()
            if step in (2, 3, 7):
                next(model.parameters()).grad.view(-1)[0] = math.inf
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            out.append(scaler.get_scale())
        return out + [float(p.detach().sum()) for p in model.parameters()]

    kwargs = {"init_scale": 2.0**20, "growth_interval": 2}
    ours = trace(dscale.GradScaler("cpu", policy="dynamic", **kwargs))
    assert ours == trace(torch.amp.GradScaler("cpu", **kwargs))
    assert ours == trace(dscale.GradScaler("cpu", **kwargs))


def _trained(scaler: dscale.GradScaler, steps: range, model: nn.Module) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in steps:
        scaler.scale(_loss(model, step) * (40.0 if step == 5 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out.append(scaler.get_scale())
    return out


def test_a_resumed_predictive_scaler_continues_exactly() -> None:
    kwargs = {"policy": "predictive", "growth_interval": 2}
    whole = _trained(dscale.GradScaler("cpu", **kwargs), range(10), _mlp(5))
    first = dscale.GradScaler("cpu", **kwargs)
    model = _mlp(5)
    head = _trained(first, range(4), model)
    saved = copy.deepcopy(first.state_dict())
    assert saved["dscale_format_version"] == 4 and saved["policy"] == "predictive"
    assert len(saved["predictive_window"]) == 8 and len(saved["predictive_memory"]) == 2
    assert saved["_predictive_window_pos"] == 4 and saved["_predictive_memory_pos"] == 0
    resumed = dscale.GradScaler("cpu", **kwargs)
    resumed.load_state_dict(saved)
    assert head + _trained(resumed, range(4, 10), model) == whole


def test_state_dicts_load_across_policies_and_say_what_was_reset(caplog) -> None:
    model = _mlp(6)
    predictive = dscale.GradScaler("cpu", policy="predictive")
    _trained(predictive, range(3), model)
    dynamic = dscale.GradScaler("cpu")
    _trained(dynamic, range(3), _mlp(6))
    torch_sd = torch.amp.GradScaler("cpu", init_scale=2.0**9).state_dict()
    assert dynamic.state_dict()["dscale_format_version"] == 1  # dynamic dicts are unchanged

    with caplog.at_level(logging.WARNING, logger="dscale"):
        target = dscale.GradScaler("cpu", policy="predictive")
        target.load_state_dict(torch_sd)
    assert target.get_scale() == 2.0**9
    assert "no predictive window" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dscale"):
        target.load_state_dict(dynamic.state_dict())
    assert "window starts empty" in caplog.text and target.get_scale() == dynamic.get_scale()
    caplog.clear()
    old = {  # a version 2 dict, from the margin rule
        **dynamic.state_dict(),
        "dscale_format_version": 2,
        "policy": "predictive",
        "predictive_margin_log2": 2,
        "_predictive_rise_tracker": 0,
        "_predictive_measured": True,
    }
    with caplog.at_level(logging.WARNING, logger="dscale"):
        target.load_state_dict(old)
    assert "before format version 4" in caplog.text and target.get_scale() == dynamic.get_scale()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dscale"):
        short = dscale.GradScaler("cpu", policy="predictive", predictive_window=1)
        short.load_state_dict(predictive.state_dict())
    assert "predictive_window has 8 entries, this scaler's has 1" in caplog.text
    newest = predictive.state_dict()["predictive_window"][
        predictive.state_dict()["_predictive_window_pos"] - 1
    ]
    assert short.state_dict()["predictive_window"] == [newest]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dscale"):
        back = dscale.GradScaler("cpu")
        back.load_state_dict(predictive.state_dict())
    assert "ignored ['predictive_window'" in caplog.text
    assert back.get_scale() == predictive.get_scale()
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(predictive.state_dict())
    assert torch_scaler.get_scale() == predictive.get_scale()

    before = target.state_dict()
    for key, value, message in (
        ("predictive_window", [1.0, math.nan], "predictive_window must be a non-empty list"),
        ("predictive_window", [], "predictive_window must be a non-empty list"),
        ("_predictive_window_pos", 8, r"_predictive_window_pos must be an int in \[0, 8\)"),
    ):
        with pytest.raises(ValueError, match=message):
            target.load_state_dict(dict(predictive.state_dict(), **{key: value}))
        assert target.state_dict() == before  # a rejected dict changes nothing


def test_snapshot_and_metrics_expose_the_measurement_and_the_target() -> None:
    from prometheus_client.core import CollectorRegistry

    from dscale.metrics._collector import ScalerCollector

    scaler = dscale.GradScaler("cpu", policy="predictive")
    model = _mlp(7)
    assert math.isnan(scaler.snapshot()["grad_max_abs"])
    _trained(scaler, range(2), model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scale = scaler.get_scale()
    scaler.scale(_loss(model, 2)).backward()
    # The oracle: the largest unscaled magnitude over every grad (exact: the scale is 2**k).
    largest = max((p.grad.abs().max() / scale).item() for p in model.parameters())
    scaler.step(opt)
    scaler.update()
    snap = scaler.snapshot()
    assert snap["grad_max_abs"] == largest
    saved = scaler.state_dict()
    largest = max(saved["predictive_window"] + saved["predictive_memory"])
    assert snap["target_scale"] == _brute_force_target(largest) == scaler.get_scale()
    assert 0.0 <= snap["underflow_fraction"] < 1.0  # step 0 was a sample
    registry = CollectorRegistry()
    labels = {"rank": "0", "local_rank": "0", "node": "n", "job_name": "j"}
    registry.register(ScalerCollector(scaler, labels=labels))
    assert registry.get_sample_value("dscale_grad_max_abs", labels) == snap["grad_max_abs"]
    assert registry.get_sample_value("dscale_loss_scale_target", labels) == snap["target_scale"]
    assert registry.get_sample_value("dscale_grad_max_abs", labels) is not None
    dynamic = ScalerCollector(dscale.GradScaler("cpu"), labels=labels)
    assert "dscale_loss_scale_target" not in {m.name for m in dynamic.collect()}


def test_predictive_state_survives_a_dcp_checkpoint_and_loads_across_policies(
    tmp_path, caplog
) -> None:
    from dscale.checkpoint import CheckpointManager

    model = _mlp(8)
    scaler = dscale.GradScaler("cpu", policy="predictive")
    _trained(scaler, range(6), model)  # the x40 step backs off: its entry is in the window
    saved = scaler.state_dict()
    assert max(saved["predictive_memory"]) == 65504.0 / scaler.get_scale() / 2
    CheckpointManager(tmp_path / "p").save(6, model=model, scaler=scaler)
    dynamic = dscale.GradScaler("cpu")
    _trained(dynamic, range(2), _mlp(8))
    CheckpointManager(tmp_path / "d").save(2, model=model, scaler=dynamic)

    resumed = dscale.GradScaler("cpu", policy="predictive")
    CheckpointManager(tmp_path / "p").resume("auto", scaler=resumed)
    assert resumed.state_dict() == saved
    with caplog.at_level(logging.WARNING, logger="dscale"):
        plain = dscale.GradScaler("cpu")
        CheckpointManager(tmp_path / "p").resume("auto", scaler=plain)
        fresh = dscale.GradScaler("cpu", policy="predictive")
        CheckpointManager(tmp_path / "d").resume("auto", scaler=fresh)
    assert plain.get_scale() == scaler.get_scale()
    assert "ignored ['predictive_window'" in caplog.text
    assert fresh.get_scale() == dynamic.get_scale()
    assert max(fresh.state_dict()["predictive_memory"]) == 0.0
    assert "window starts empty" in caplog.text


def test_a_checkpoint_with_a_bad_predictive_value_is_refused_before_the_model_changes(
    tmp_path,
) -> None:
    from dscale.checkpoint import CheckpointError, CheckpointManager

    model = _mlp(8)
    scaler = dscale.GradScaler("cpu", policy="predictive")
    _trained(scaler, range(2), model)
    good = scaler.state_dict()
    scaler.state_dict = lambda: {**good, "_predictive_window_pos": 99999}  # type: ignore[method-assign]
    CheckpointManager(tmp_path).save(2, model=model, scaler=scaler)

    target, resumed = _mlp(8), dscale.GradScaler("cpu", policy="predictive")
    with torch.no_grad():
        for p in target.parameters():
            p.add_(1.0)  # differs from the saved model: a load that went ahead would show
    before = [p.detach().clone() for p in target.parameters()]
    state_before = resumed.state_dict()
    with pytest.raises(CheckpointError, match="_predictive_window_pos"):
        CheckpointManager(tmp_path).resume("auto", model=target, scaler=resumed)
    assert all(torch.equal(p, q) for p, q in zip(target.parameters(), before, strict=True))
    assert resumed.state_dict() == state_before


def _forms(steps: int, poison, weight=lambda step: 1.0, **kwargs) -> list[list[tuple]]:
    """The host and device forms (fused SGD, decided on the device) over the same run."""
    out = []
    for device_form in (False, True):
        scaler = dscale.GradScaler("cpu", policy="predictive", **kwargs)
        if device_form:
            decide_on_device(scaler)
        model = _mlp(11)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=device_form)
        trace = []
        for step in range(steps):
            scaler.scale(_loss(model, step) * weight(step)).backward()
            if poison(step):
                next(model.parameters()).grad.view(-1)[0] = math.nan
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            snap = scaler.snapshot()
            trace.append((scaler.get_scale(), snap["grad_max_abs"], snap["skipped_steps"]))
        out.append(trace)
    return out


def _same(a: list[tuple], b: list[tuple]) -> bool:
    def key(row: tuple) -> tuple:
        return tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in row)

    return [key(r) for r in a] == [key(r) for r in b]


def test_an_overflow_every_step_runs_the_scale_down_like_torch_without_raising() -> None:
    host, device = _forms(160, lambda step: step >= 2)
    assert _same(host, device)
    assert host[-1][0] == 0.0 and host[-1][2] == 158  # underflowed to 0, as torch's does
    assert math.isnan(host[-1][1])  # an overflowed step measured nothing usable


def test_telemetry_agrees_across_forms_after_overflows_and_empty_steps() -> None:
    host, device = _forms(12, lambda step: step == 5, weight=lambda step: 0.0 if step == 8 else 1)
    assert _same(host, device)
    assert math.isnan(host[5][1]) and host[8][1] == 0.0 and host[9][1] > 0


def test_a_step_the_spike_gate_skips_stays_out_of_the_window() -> None:
    # max_scale leaves room for a 20x loss that does not overflow: a spike, not an overflow.
    spike = {"init_scale": 2.0**10, "max_scale": 2.0**10}
    gate = {"spike_signals": ("loss",), "spike_warmup": 4, "spike_window": 8}
    host, device = _forms(
        14, lambda step: False, weight=lambda s: 20 if s == 10 else 1, **spike, **gate
    )
    assert _same(host, device)
    assert host[10][2] == 0  # not an overflow
    assert host[10][1] == 0.0  # the spike's measurement was left out of the window
    ungated, _ = _forms(14, lambda step: False, weight=lambda s: 20 if s == 10 else 1, **spike)
    assert ungated[10][1] > 10 * ungated[9][1]  # without the gate it enters
