"""Any optimizer: foreach, fused and capturable step correctly; fused and sync-free never sync."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dscale
from tests.scaler._setup import decide_on_device

pytestmark = pytest.mark.filterwarnings("ignore:dscale.GradScaler.*:UserWarning")

POISON = {1, 3, 4}


def _train(scaler, make_opt, steps=7, seed=0, poison=POISON):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = make_opt(model.parameters())
    for step in range(steps):
        torch.manual_seed(100 + step)
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 6)).square().mean()).backward()
        if step in poison:
            model[2].bias.grad[1] = float("inf")
        scaler.step(opt)
        scaler.update()
    return model, opt


OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adam-single-tensor": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_optimizer_matches_torch_gradscaler_bit_for_bit(name) -> None:
    ours_model, ours_opt = _train(dscale.GradScaler("cpu", init_scale=2.0**8), OPTIMIZERS[name])
    ref_model, ref_opt = _train(torch.amp.GradScaler("cpu", init_scale=2.0**8), OPTIMIZERS[name])
    for p, q in zip(ours_model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
    steps = [s["step"] for s in ours_opt.state.values() if "step" in s]
    ref_steps = [s["step"] for s in ref_opt.state.values() if "step" in s]
    assert [float(s) for s in steps] == [float(s) for s in ref_steps]


def test_fused_sgd_with_a_skipped_first_step_matches_foreach_sgd() -> None:
    # torch's fused SGD leaves its momentum buffer uninitialised when the first step is skipped;
    # dscale zeroes state created by a skipped fused step, so the run matches the foreach path.
    first_skipped = {0, 3}
    fused, _ = _train(dscale.GradScaler("cpu"), OPTIMIZERS["sgd-fused"], poison=first_skipped)
    plain, _ = _train(dscale.GradScaler("cpu"), OPTIMIZERS["sgd-momentum"], poison=first_skipped)
    for p, q in zip(fused.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["sgd-momentum", "adam-foreach", "adam-single-tensor"])
def test_sync_free_steps_give_the_same_result_as_skipping(name) -> None:
    skip_model, _ = _train(dscale.GradScaler("cpu", init_scale=2.0**8), OPTIMIZERS[name])
    free_model, _ = _train(
        decide_on_device(dscale.GradScaler("cpu", init_scale=2.0**8, sync_free=True)),
        OPTIMIZERS[name],
    )
    for p, q in zip(skip_model.parameters(), free_model.parameters()):
        assert torch.equal(p, q), name


def _count_host_reads(monkeypatch, scaler, opt_factory, *, warm_up: bool = True):
    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    opt = opt_factory(model.parameters())
    if warm_up:  # the first step creates the optimizer state, read separately below
        scaler.scale(model(torch.randn(3, 6)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    scaler.scale(model(torch.randn(3, 6)).sum()).backward()
    reads = []
    for method in ("item", "tolist", "__bool__"):
        real = getattr(torch.Tensor, method)

        def counted(self, *a, _real=real, _name=method):
            reads.append(_name)
            return _real(self, *a)

        monkeypatch.setattr(torch.Tensor, method, counted)
    scaler.step(opt)
    scaler.update()
    monkeypatch.undo()
    return reads


def test_fused_and_sync_free_steps_read_nothing_back_from_the_device(monkeypatch) -> None:
    # The device-side decision (what a GPU runs), forced on the CPU.
    def on_device(**kwargs):
        return decide_on_device(dscale.GradScaler("cpu", **kwargs))

    fused = _count_host_reads(monkeypatch, on_device(), OPTIMIZERS["adam-fused"])
    # SGD: Adam without capturable=True reads its own step counter on the host.
    free = _count_host_reads(monkeypatch, on_device(sync_free=True), OPTIMIZERS["sgd-momentum"])
    plain = _count_host_reads(monkeypatch, on_device(), OPTIMIZERS["sgd-momentum"])
    assert fused == []
    assert free == []
    assert plain == ["tolist"]  # the skip decision, as torch's scaler makes it (one copy)
    # policy="predictive": the measurement rides in the same reads (one copy of the vector).
    kwargs = {"policy": "predictive"}
    fused = _count_host_reads(monkeypatch, on_device(**kwargs), OPTIMIZERS["adam-fused"])
    free = _count_host_reads(
        monkeypatch, on_device(sync_free=True, **kwargs), OPTIMIZERS["sgd-momentum"]
    )
    plain = _count_host_reads(monkeypatch, on_device(**kwargs), OPTIMIZERS["sgd-momentum"])
    assert (fused, free, plain) == ([], [], ["tolist"])
    # The step that creates optimizer state reads the flag once: state a skipped step created
    # must be removed (not zeroed) to equal skipping. Normally once per run.
    for policy in ("dynamic", "predictive"):
        for scaler, factory in (
            (on_device(policy=policy), OPTIMIZERS["adam-fused"]),
            (on_device(sync_free=True, policy=policy), OPTIMIZERS["sgd-momentum"]),
        ):
            reads = _count_host_reads(monkeypatch, scaler, factory, warm_up=False)
            assert reads == ["item"], policy


def test_an_optimizer_that_keeps_no_state_costs_no_host_read_on_any_step(monkeypatch) -> None:
    # SGD without momentum never creates state, so no step is "the one that creates it": with
    # the device-side decision it reads nothing back, the first step included.
    stateless = {
        "fused": lambda p: torch.optim.SGD(p, lr=0.1, fused=True),
        "foreach": lambda p: torch.optim.SGD(p, lr=0.1, foreach=True),
    }
    for sync_free, factory in ((False, "fused"), (True, "foreach"), (True, "fused")):
        for warm_up in (False, True):
            scaler = decide_on_device(dscale.GradScaler("cpu", sync_free=sync_free))
            reads = _count_host_reads(monkeypatch, scaler, stateless[factory], warm_up=warm_up)
            assert reads == [], (sync_free, factory, warm_up)


def test_a_frozen_parameter_in_the_optimizer_costs_no_host_read_after_the_first_step(
    monkeypatch,
) -> None:
    # Fine-tuning: a frozen parameter (no grad, so never any state) handed to the optimizer
    # with the rest. Only the first step, which creates the others' state, reads the flag.
    frozen = nn.Parameter(torch.zeros(3), requires_grad=False)
    for sync_free, make in (
        (False, lambda p: torch.optim.Adam([*p, frozen], lr=1e-2, fused=True)),
        (True, lambda p: torch.optim.SGD([*p, frozen], lr=0.1, momentum=0.9)),
    ):
        scaler = decide_on_device(dscale.GradScaler("cpu", sync_free=sync_free))
        assert _count_host_reads(monkeypatch, scaler, make, warm_up=True) == [], sync_free


@pytest.mark.parametrize("policy", ["dynamic", "predictive"])
def test_on_the_cpu_fused_and_sync_free_steps_decide_on_the_host(monkeypatch, policy) -> None:
    # The flag is in host memory there: one read of the agreed vector, no masked step, and an
    # update in host arithmetic (the scaler's host state stays the authority).
    import dscale.scaler._api as scaler_module

    for kwargs, factory in (({}, "adam-fused"), ({"sync_free": True}, "sgd-momentum")):
        scaler = dscale.GradScaler("cpu", policy=policy, **kwargs)
        masked: list[object] = []
        monkeypatch.setattr(scaler_module, "masked_step", lambda *a, out=masked: out.append(a))
        reads = _count_host_reads(monkeypatch, scaler, OPTIMIZERS[factory])
        assert reads == ["tolist"], kwargs
        assert masked == [], kwargs
        assert scaler._book.host is not None, kwargs


def test_host_and_device_decisions_give_identical_runs() -> None:
    for kwargs, factory in (({}, "adam-fused"), ({"sync_free": True}, "sgd-momentum")):
        host_scaler = dscale.GradScaler("cpu", init_scale=2.0**8, **kwargs)
        host_model, _ = _train(host_scaler, OPTIMIZERS[factory])
        device_scaler = decide_on_device(dscale.GradScaler("cpu", init_scale=2.0**8, **kwargs))
        device_model, _ = _train(device_scaler, OPTIMIZERS[factory])
        for p, q in zip(host_model.parameters(), device_model.parameters(), strict=True):
            assert torch.equal(p, q), kwargs
        assert host_scaler.state_dict() == device_scaler.state_dict(), kwargs
        assert host_scaler.snapshot()["skipped_steps"] == len(POISON), kwargs


def test_step_applied_after_a_fused_step_reads_the_agreed_flag_lazily() -> None:
    scaler = dscale.GradScaler("cpu", init_scale=2.0**8)
    _, opt = _train(scaler, OPTIMIZERS["adam-fused"], steps=4)  # step 3 is poisoned
    assert scaler.step_applied(opt) is False
    clone = copy.deepcopy(scaler)
    assert clone.get_scale() == scaler.get_scale()
