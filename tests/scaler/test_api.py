"""torch's GradScaler API, method by method, on one CPU process."""

from __future__ import annotations

import copy
import math
import pickle
from typing import Any

import pytest
import torch
from torch import nn

import dscale

pytestmark = pytest.mark.filterwarnings("ignore:dscale.GradScaler.*:UserWarning")


def _setup(seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dscale.GradScaler("cpu", **{"init_scale": 1024.0, **kwargs})
    return model, opt, scaler


def _backward(model, scaler, poison=False):
    loss = model(torch.randn(2, 4)).sum()
    scaler.scale(loss).backward()
    if poison:
        model.weight.grad[0, 0] = float("inf")


def test_scale_multiplies_tensors_and_nested_lists_and_tuples() -> None:
    scaler = dscale.GradScaler("cpu", init_scale=8.0)
    t = torch.tensor(2.0)
    assert scaler.scale(t).item() == 16.0
    out = scaler.scale([t, (t, [t])])
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], list)
    assert out[1][1][0].item() == 16.0
    with pytest.raises(ValueError, match="Tensor or an iterable"):
        scaler.scale([t, 3])


def test_unscale_divides_grads_and_refuses_a_second_call_before_update() -> None:
    model, opt, scaler = _setup()
    _backward(model, scaler)
    scaled = model.weight.grad.clone()
    scaler.unscale_(opt)
    torch.testing.assert_close(model.weight.grad, scaled / 1024.0, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="already been called on this optimizer"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    scaler.update()
    _backward(model, scaler)
    scaler.unscale_(opt)  # allowed again after update()


def test_step_returns_the_optimizer_value_or_none_when_skipped() -> None:
    model, opt, scaler = _setup()
    opt.step = lambda *a, **k: "stepped"  # type: ignore[method-assign]
    _backward(model, scaler)
    assert scaler.step(opt) == "stepped"
    scaler.update()
    _backward(model, scaler, poison=True)
    assert scaler.step(opt) is None
    assert scaler.step_applied(opt) is False
    scaler.update()
    assert scaler.get_scale() == 512.0


def test_step_forwards_args_and_refuses_closures() -> None:
    model, opt, scaler = _setup()
    seen = {}
    opt.step = lambda *a, **k: seen.update(args=a, kwargs=k)  # type: ignore[method-assign]
    _backward(model, scaler)
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: 0.0)
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, lambda: 0.0)
    scaler.step(opt, 1, flag=True)
    assert seen == {"args": (1,), "kwargs": {"flag": True}}


def test_update_with_new_scale_float_or_tensor_and_rejects_bad_values() -> None:
    model, opt, scaler = _setup()
    _backward(model, scaler)
    scaler.step(opt)
    scaler.update(new_scale=64.0)
    assert scaler.get_scale() == 64.0
    _backward(model, scaler)
    scaler.step(opt)
    scaler.update(torch.tensor([32.0]))
    assert scaler.get_scale() == 32.0
    for bad in (0.0, float("inf"), -1.0, True):
        with pytest.raises(ValueError, match="new_scale"):
            scaler.update(bad)
    with pytest.raises(ValueError, match="one-element"):
        scaler.update(torch.ones(2))
    assert scaler.get_scale() == 32.0


def test_update_without_any_step_is_an_error_that_says_what_to_do() -> None:
    _, _, scaler = _setup()
    scaler.scale(torch.tensor(1.0))
    with pytest.raises(RuntimeError, match=r"scaler\.step"):
        scaler.update()
    fresh = dscale.GradScaler("cpu")
    with pytest.raises(RuntimeError, match="before scale"):
        fresh.update()


def test_getters_setters_and_is_enabled() -> None:
    scaler = dscale.GradScaler("cpu", growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    assert scaler.is_enabled()
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (3.0, 0.25)
    assert scaler.get_growth_interval() == 7
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.125)
    scaler.set_growth_interval(9)
    assert scaler.state_dict()["growth_factor"] == 4.0
    assert scaler.state_dict()["backoff_factor"] == 0.125
    assert scaler.state_dict()["growth_interval"] == 9
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_growth_factor(1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        scaler.set_backoff_factor(1.5)
    with pytest.raises(ValueError, match="growth_interval"):
        scaler.set_growth_interval(0)
    assert scaler.get_growth_factor() == 4.0


def test_disabled_scaler_is_a_transparent_pass_through() -> None:
    model, opt, _ = _setup()
    scaler = dscale.GradScaler("cpu", enabled=False)
    loss = model(torch.randn(2, 4)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    grad = model.weight.grad.clone()
    scaler.unscale_(opt)
    assert torch.equal(model.weight.grad, grad)
    before = model.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(model.weight, before)
    assert scaler.get_scale() == 1.0
    assert scaler.state_dict() == {}
    assert not scaler.is_enabled()
    scaler.load_state_dict({"anything": 1})  # a no-op, as torch's


def test_multiple_losses_and_optimizers_follow_torch_semantics() -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(4, 2), nn.Linear(4, 2)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    scaler = dscale.GradScaler("cpu", init_scale=256.0)
    x = torch.randn(3, 4)
    loss_a, loss_b = a(x).sum(), b(x).sum()
    scaler.scale(loss_a).backward(retain_graph=True)
    scaler.scale(loss_b).backward()
    b.weight.grad[0, 0] = float("nan")
    before_a, before_b = a.weight.detach().clone(), b.weight.detach().clone()
    scaler.step(opt_a)
    scaler.step(opt_b)
    scaler.update()
    # Each optimizer skips on its own grads only; the scale backs off once.
    assert not torch.equal(a.weight, before_a)
    assert torch.equal(b.weight, before_b)
    assert (scaler.step_applied(opt_a), scaler.step_applied(opt_b)) == (True, False)
    assert scaler.get_scale() == 128.0
    assert scaler.snapshot()["backoffs"] == 1


def test_step_callbacks_see_whether_each_step_was_applied() -> None:
    model, opt, scaler = _setup()
    seen = []
    unregister = scaler.register_step_callback(lambda o, applied: seen.append(applied))
    for poison in (False, True, False):
        _backward(model, scaler, poison)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    unregister()
    _backward(model, scaler)
    scaler.step(opt)
    assert seen == [True, False, True]


def test_pickle_and_deepcopy_keep_the_state_and_refuse_mid_iteration() -> None:
    model, opt, scaler = _setup(growth_interval=3)
    for poison in (False, True, False, False):
        _backward(model, scaler, poison)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    for clone in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert clone.state_dict() == scaler.state_dict()
    _backward(model, scaler)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="pickled"):
        pickle.dumps(scaler)


# A pickle is a same-version format (it names private module paths; the versioned state dict is
# what crosses versions): each configuration pickled mid-run must go on exactly as the run that
# was never pickled.
_PICKLE_GATE = {"spike_window": 4, "spike_warmup": 2, "spike_sigma": 3.0}
_PICKLE_RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    "dynamic": ("scaler", {}),
    "predictive": ("scaler", {"policy": "predictive"}),
    "spike_gate": ("scaler", {"spike_signals": ("loss", "grad_norm"), **_PICKLE_GATE}),
    "predictive_spike_gate": (
        "scaler",
        {"policy": "predictive", "spike_signals": ("loss",), **_PICKLE_GATE},
    ),
    "step_guard_spike_gate": ("guard", {"spike_signals": ("grad_norm",), **_PICKLE_GATE}),
}


def _pickle_subject(kind: str, kwargs: dict[str, Any]) -> Any:
    if kind == "guard":
        return dscale.StepGuard("cpu", **kwargs)
    return dscale.GradScaler("cpu", init_scale=2.0**10, growth_interval=3, **kwargs)


def _train_on_fixed_grads(scaler: Any, steps: int, seed: int) -> list[Any]:
    """``steps`` iterations on fixed grads (an overflow, a loss and a grad spike among them):
    every step's applied flag and snapshot, then the state dict and the weights."""
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(n, generator=gen)) for n in (5, 3)]
    opt = torch.optim.SGD(params, lr=1e-2)
    trace: list[Any] = []
    for step in range(steps):
        loss = 2.0 + 0.01 * step + (50.0 if step == 9 else 0.0)
        scale = scaler.get_scale()
        scaler.scale(torch.tensor(loss))
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * scale * (100.0 if step == 10 else 1.0)
        if step == 3:
            params[1].grad[0] = math.inf
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        applied = any(not torch.equal(b, p) for b, p in zip(before, params, strict=True))
        scaler.update()
        trace.append([applied, scaler.snapshot()])
    trace.append(scaler.state_dict())
    trace.append([p.detach().clone() for p in params])
    return trace


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested traces (tensors by torch.equal, floats by their bits)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return isinstance(b, float) and a.hex() == b.hex()
    return type(a) is type(b) and a == b


@pytest.mark.filterwarnings("ignore:dscale.StepGuard.*:UserWarning")
@pytest.mark.parametrize("name", list(_PICKLE_RUNS))
def test_a_scaler_pickled_mid_run_goes_on_as_the_run_never_pickled(name: str) -> None:
    """Oracle: the same scaler trained on without the pickle (decisions, snapshots, state dict,
    weights, bit for bit); a pickle that dropped the spike window, predictive's rings or what
    the last step measured decides otherwise. The pickle of the unpickled copy goes on alike."""
    kind, kwargs = _PICKLE_RUNS[name]
    scaler = _pickle_subject(kind, kwargs)
    _train_on_fixed_grads(scaler, 6, 0)
    data = pickle.dumps(scaler)
    again = pickle.dumps(pickle.loads(data))
    expected = _train_on_fixed_grads(scaler, 12, 1)
    assert _same(_train_on_fixed_grads(pickle.loads(data), 12, 1), expected)
    assert _same(_train_on_fixed_grads(pickle.loads(again), 12, 1), expected)


def test_fp16_grads_are_unscaled_in_fp32_math() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.full((8,), 1.0, dtype=torch.float16))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler = dscale.GradScaler("cpu", init_scale=3.0)
    w.grad = torch.full((8,), 3.0 * 1e-3, dtype=torch.float16)
    scaler.scale(torch.tensor(1.0, requires_grad=True))
    scaler.unscale_(opt)
    expected = (torch.tensor(3.0 * 1e-3, dtype=torch.float16).float() * (1 / 3.0)).half()
    assert w.grad.dtype is torch.float16
    assert torch.equal(w.grad, torch.full((8,), expected.item(), dtype=torch.float16))


def test_bf16_training_gets_one_warning_that_scaling_is_not_needed(monkeypatch) -> None:
    import dscale.scaler._warnings as w

    monkeypatch.setattr(w, "_checked", False)
    model = nn.Linear(4, 2).bfloat16()
    scaler = dscale.GradScaler("cpu")
    with pytest.warns(UserWarning, match="bfloat16.*not needed|only needed for float16"):
        scaler.scale(model(torch.randn(2, 4).bfloat16()).sum())
    monkeypatch.setattr(w, "_checked", False)
    with torch.autocast("cpu", dtype=torch.float16):
        fp16_loss = model.float()(torch.randn(2, 4)).float().sum()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.scale(fp16_loss)  # fp16 autocast: no warning


def test_scaled_training_equals_unscaled_fp32_training_that_skips_the_same_steps() -> None:
    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    scaled = copy.deepcopy(ref)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_s = torch.optim.SGD(scaled.parameters(), lr=0.05, momentum=0.9)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for step in range(12):
        x = torch.randn(5, 4)
        opt_ref.zero_grad()
        opt_s.zero_grad()
        scaler.scale(scaled(x).square().mean()).backward()
        if step in (3, 7):
            scaled.bias.grad[0] = float("inf")
        scaler.step(opt_s)
        scaler.update()
        if step not in (3, 7):
            ref(x).square().mean().backward()
            opt_ref.step()
        for p, q in zip(ref.parameters(), scaled.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert scaler.snapshot()["skipped_steps"] == 2
