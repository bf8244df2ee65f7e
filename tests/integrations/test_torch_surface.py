"""dscale.GradScaler is a torch.amp.GradScaler, and torch's private surface reads as torch's does.

The oracle is torch's own scaler: the same iterations run through both, and every private read
that code in the wild makes is compared after each stage.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.amp.grad_scaler import OptState

import dscale

pytestmark = pytest.mark.filterwarnings("ignore:dscale.GradScaler.*:UserWarning")

POISONED = (2, 5)  # iterations with an inf in the grads
STEPS = 8


def test_dscale_scaler_is_a_torch_gradscaler() -> None:
    assert isinstance(dscale.GradScaler("cpu"), torch.amp.GradScaler)


def test_no_torch_method_runs_on_a_dscale_scaler() -> None:
    # Every function torch's class defines resolves to one written in dscale.
    torch_methods = {
        name
        for name, value in vars(torch.amp.GradScaler).items()
        if inspect.isfunction(value) or isinstance(value, property)
    }
    assert {"scale", "step", "update", "unscale_", "_unscale_grads_", "__init__"} <= torch_methods
    for name in sorted(torch_methods):
        resolved = inspect.getattr_static(dscale.GradScaler, name)
        target = resolved.fget if isinstance(resolved, property) else resolved
        assert target.__module__.startswith("dscale."), (name, target.__module__)
    # torch's attributes that code reads are answered by dscale (torch's __init__ never ran).
    for name in ("_scale", "_growth_tracker", "_per_optimizer_states", "_growth_factor"):
        assert isinstance(inspect.getattr_static(dscale.GradScaler, name), property), name


@pytest.mark.parametrize(
    ("name", "fix"),
    [
        ("_unscale_grads_", "unscale_"),
        ("_maybe_opt_step", "step"),
    ],
)
def test_torch_helpers_without_a_dscale_meaning_raise_with_the_fix(name: str, fix: str) -> None:
    scaler = dscale.GradScaler("cpu")
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    args = {
        "_unscale_grads_": (opt, torch.ones(()), torch.zeros(()), False),
        "_maybe_opt_step": (opt, {}),
    }[name]
    with pytest.raises(NotImplementedError, match=rf"{name}\(\).*scaler\.{fix}\(optimizer\)"):
        getattr(scaler, name)(*args)


def test_writes_to_the_private_tensors_are_refused_and_change_nothing() -> None:
    scaler = dscale.GradScaler("cpu", init_scale=8.0)
    scaler._lazy_init_scale_growth_tracker("cpu")
    with pytest.raises(AttributeError, match=r"read-only.*update\(new_scale"):
        scaler._scale = torch.tensor(1.0)
    with pytest.raises(AttributeError, match="read-only"):
        scaler._growth_tracker = torch.tensor(3)
    assert scaler.get_scale() == 8.0
    assert scaler._growth_tracker.item() == 0


@contextmanager
def _no_host_reads():
    """Fail on any tensor-to-Python read (the CPU stand-in for a host sync on GPU)."""
    names = ("item", "tolist", "__bool__", "__float__", "__int__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(*args, **kwargs):
        raise AssertionError("a private read synced with the device")

    for n in names:
        setattr(torch.Tensor, n, refuse)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def _private_reads(scaler, opt, *, synced: bool = True) -> dict:
    """What code in the wild reads; the reads themselves must not sync."""
    with _no_host_reads():
        scale, tracker = scaler._scale, scaler._growth_tracker
        state = scaler._per_optimizer_states[id(opt)]
        found = scaler._found_inf_per_device(opt)
        stage = state["stage"]
        devices = sorted(str(d) for d in state["found_inf_per_device"])
    return {
        "scale": None if scale is None else scale.item(),
        "tracker": None if tracker is None else int(tracker.item()),
        "stage": stage,
        "found": sum(v.item() for v in found.values()) > 0,
        "devices": devices,
    }


def _run(scaler, opt_factory) -> list[dict]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = opt_factory(model.parameters())
    trace = [{"before_scale": _private_reads(scaler, opt)}]
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(torch.randn(5, 4)).square().mean()
        scaler.scale(loss).backward()
        if step in POISONED:
            model.weight.grad[0, 0] = float("inf")
        row = {"after_backward": _private_reads(scaler, opt)}
        if step % 2:
            scaler.unscale_(opt)
            row["after_unscale"] = _private_reads(scaler, opt)
        scaler.step(opt)
        row["after_step"] = _private_reads(scaler, opt)
        scaler.update()
        row["after_update"] = _private_reads(scaler, opt)
        row["params"] = [p.detach().clone() for p in model.parameters()]
        trace.append(row)
    return trace


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
}


@pytest.mark.parametrize("sync_free", [False, True], ids=["plain", "sync_free"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_private_reads_match_torch_at_every_stage(optimizer: str, sync_free: bool) -> None:
    kwargs = {"init_scale": 2.0**10, "growth_interval": 2}
    expected = _run(torch.amp.GradScaler("cpu", **kwargs), OPTIMIZERS[optimizer])
    got = _run(dscale.GradScaler("cpu", sync_free=sync_free, **kwargs), OPTIMIZERS[optimizer])
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        for key in want:
            if key == "params":
                for a, b in zip(want[key], have[key], strict=True):
                    torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"step {step}")
            else:
                assert have[key] == want[key], (step, key)
    # The trace covered what it claims: skips, unscale before step, growth.
    stages = {row[k]["stage"] for row in expected[1:] for k in row if k != "params"}
    assert stages == {OptState.READY, OptState.UNSCALED, OptState.STEPPED}
    assert [r["after_step"]["found"] for r in expected[1:]] == [s in POISONED for s in range(8)]


def test_accelerate_fsdp2_load_pattern_restores_the_scale_before_any_scale_call() -> None:
    # accelerate.Accelerator.load_state under FSDP2 (accelerator.py ~3870), verbatim in shape.
    for make in (torch.amp.GradScaler, dscale.GradScaler):
        source = make("cpu", init_scale=4.0)
        source.load_state_dict({**source.state_dict(), "scale": 32.0, "_growth_tracker": 3})
        scaler = make("cpu")
        scaler.load_state_dict(source.state_dict())
        scaler._lazy_init_scale_growth_tracker(scaler._device)
        assert scaler._scale.item() == 32.0, make
        assert scaler._growth_tracker.item() == 3, make
        loss = torch.ones((), requires_grad=True)
        assert scaler.scale(loss).item() == 32.0, make
    # dscale: a second call on the same device is harmless, another device is refused.
    scaler._lazy_init_scale_growth_tracker("cpu")
    with pytest.raises(RuntimeError, match="already lives on cpu"):
        scaler._lazy_init_scale_growth_tracker("meta")


def test_a_read_of_an_unstepped_optimizer_does_not_disturb_update() -> None:
    # torch's defaultdict hands out a fresh READY state; reading it must not add an optimizer
    # with no check to what update() consumes.
    scaler = dscale.GradScaler("cpu", init_scale=4.0)
    model = nn.Linear(2, 2)
    opt, other = (torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(2))
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    assert scaler._per_optimizer_states[id(other)]["stage"] is OptState.READY
    scaler.step(opt)
    scaler.update()
    assert scaler.state_dict()["_growth_tracker"] == 1
    assert len(scaler._per_optimizer_states) == 0


def test_pickled_copy_keeps_torch_view_and_state() -> None:
    import pickle

    scaler = dscale.GradScaler("cpu", init_scale=16.0)
    scaler._lazy_init_scale_growth_tracker("cpu")
    copy = pickle.loads(pickle.dumps(scaler))
    assert isinstance(copy, torch.amp.GradScaler)
    assert copy.get_scale() == 16.0
    assert copy._per_optimizer_states[0]["stage"] is OptState.READY


def test_disabled_scaler_reads_like_a_disabled_torch_scaler() -> None:
    scaler = dscale.GradScaler("cpu", enabled=False)
    assert scaler._scale is None and scaler._growth_tracker is None
    assert scaler._get_growth_tracker() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (sync debug mode)")
@pytest.mark.parametrize("sync_free", [False, True], ids=["fused", "sync_free"])
def test_private_reads_do_not_sync_with_the_gpu(sync_free: bool) -> None:
    model = nn.Linear(64, 64).cuda()
    fused = not sync_free
    opt = torch.optim.Adam(model.parameters(), fused=fused, foreach=None if fused else True)
    scaler = dscale.GradScaler("cuda", sync_free=sync_free)
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.randn(8, 64, device="cuda")).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        torch.cuda.set_sync_debug_mode("error")
        try:
            view = scaler._per_optimizer_states[id(opt)]
            assert view["stage"] is OptState.STEPPED
            assert view["found_inf_per_device"]
            assert scaler._found_inf_per_device(opt)
            scaler.update()
            assert scaler._scale.device.type == "cuda"
            assert scaler._growth_tracker.device.type == "cuda"
            assert scaler._get_scale_async() is scaler._scale
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad()
