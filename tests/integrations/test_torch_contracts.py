"""torch's contracts that code written for torch's scaler relies on; torch's scaler is the oracle.

- Optimizers that do the scaling themselves (``_step_supports_amp_scaling``): torch passes itself
  as ``grad_scaler=`` when ``step()`` takes that keyword (apex's and Transformer Engine's fused
  optimizers then check, unscale and skip in their own kernel), otherwise sets ``grad_scale`` and
  ``found_inf`` on the optimizer during the call and hands over the grads still scaled.
- Writes into torch's private state by code that unscales grads itself
  (``_per_optimizer_states[id(opt)]["stage"] = OptState.UNSCALED``, ``["found_inf_per_device"]``).
- ``torch.compile`` around the scaler: tests/scaler/test_compile.py.
Each runs the same steps through torch's scaler and dscale's and compares the weights bit for
bit; on 2 gloo ranks an inf on one rank is skipped on both.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.amp.grad_scaler import OptState

import dscale
from tests.multirank import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:dscale.GradScaler.*:UserWarning")


class PassItself(torch.optim.Optimizer):
    """apex/TE style: ``step(grad_scaler=...)`` checks, unscales and skips in its own code."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None, *, grad_scaler: Any = None) -> None:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        found, inv = torch.zeros(()), torch.ones(())
        if grad_scaler is not None:
            found = sum(
                f.to(found.device) for f in grad_scaler._check_inf_per_device(self).values()
            )
            inv = grad_scaler._get_scale_async().double().reciprocal().float()
        for p in params:
            p.copy_(torch.where(found > 0, p, p - self.defaults["lr"] * (p.grad * inv)))


class ReadsAttributes(torch.optim.Optimizer):
    """torch's newer contract: reads ``self.grad_scale`` and ``self.found_inf`` during step()."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        grad_scale, found = self.grad_scale, self.found_inf  # tensors, as torch sets them
        for g in self.param_groups:
            for p in g["params"]:
                update = p - self.defaults["lr"] * (p.grad / grad_scale)
                p.copy_(torch.where(found > 0, p, update))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _loss(model: nn.Module, step: int, poison: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    loss = model(torch.randn(4, 6, generator=g)).square().mean()
    return loss * float("inf") if poison else loss


def _self_unscaling_step(scaler: Any, opt: torch.optim.Optimizer) -> None:
    """What a model-parallel helper does: unscale and check the grads itself, tell the scaler."""
    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    found = torch.zeros(())
    inv = scaler._scale.double().reciprocal().float()
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    state = scaler._per_optimizer_states[id(opt)]
    state["stage"] = OptState.UNSCALED
    state["found_inf_per_device"] = {found.device: found}
    scaler.step(opt)


def _flag_after_unscale(scaler: Any, opt: torch.optim.Optimizer, found: bool) -> None:
    """A helper that checks grads itself after unscale_() and writes its flag when it found one;
    torch's step() and update() read it (issue 33 item 2)."""
    scaler.unscale_(opt)
    if found:
        flag = torch.tensor(1.0)
        scaler._per_optimizer_states[id(opt)]["found_inf_per_device"] = {flag.device: flag}
    scaler.step(opt)


def _run(scaler: Any, make_opt: Any, skips: set[int], how: str, steps: int = 5) -> dict:
    model = _model()
    opt = make_opt(model.parameters())
    scales = []
    for step in range(steps):
        opt.zero_grad()
        written = how == "flag_after_unscale"  # the loss stays finite: the flag says "found"
        scaler.scale(_loss(model, step, step in skips and not written)).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's, for grad_scaler=
            if how == "self_unscaled":
                _self_unscaling_step(scaler, opt)
            elif written:
                _flag_after_unscale(scaler, opt, step in skips)
            else:
                scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"params": [p.detach().clone() for p in model.parameters()], "scales": scales}


CASES = {
    "pass_itself": (PassItself, "step"),
    "reads_attributes": (ReadsAttributes, "step"),
    "self_unscaled_sgd": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "self_unscaled"),
    "self_unscaled_adam_fused": (
        lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
        "self_unscaled",
    ),
    "flag_after_unscale_sgd": (
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "flag_after_unscale",
    ),
    "flag_after_unscale_adam_foreach": (
        lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
        "flag_after_unscale",
    ),
    "flag_after_unscale_adam_fused": (
        lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
        "flag_after_unscale",
    ),
}
SKIPS = {"none": set(), "first": {0}, "mid": {2}, "twice": {1, 2}}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("decide_on_device", [False, True], ids=["host", "device"])
def test_dscale_equals_torch_for_each_contract_and_skip_pattern(case, decide_on_device) -> None:
    make_opt, how = CASES[case]
    for name, skips in SKIPS.items():
        ref = _run(torch.amp.GradScaler("cpu", init_scale=2.0**8), make_opt, skips, how)
        scaler = dscale.GradScaler("cpu", init_scale=2.0**8)
        scaler._read_host_flags = not decide_on_device
        ours = _run(scaler, make_opt, skips, how)
        assert ours["scales"] == ref["scales"], (case, name)
        for a, b in zip(ours["params"], ref["params"], strict=True):
            assert torch.equal(a, b), (case, name)


def test_an_optimizer_passed_the_scaler_gets_it_and_no_attributes_as_from_torch() -> None:
    seen: dict[str, Any] = {}

    class Spy(PassItself):
        def step(self, closure: Any = None, *, grad_scaler: Any = None) -> None:
            seen["scaler"] = grad_scaler
            seen["attributes"] = hasattr(self, "grad_scale") or hasattr(self, "found_inf")
            super().step(grad_scaler=grad_scaler)

    model = _model()
    opt = Spy(model.parameters())
    scaler = dscale.GradScaler("cpu")
    scaler.scale(_loss(model, 0, False)).backward()
    with pytest.warns(FutureWarning, match="stop passing itself"):
        scaler.step(opt)
    assert seen == {"scaler": scaler, "attributes": False}


@pytest.mark.parametrize("decide_on_device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize(
    ("written", "found"),
    [(1.0, True), (2.0, True), (0.5, True), (float("nan"), True), (0.0, False), (-1.0, False)],
)
def test_a_written_flag_with_no_grads_left_to_check_counts_as_found_when_above_zero(
    decide_on_device, written, found
) -> None:
    # No grad for the check pass (as after attach()'s hooks checked them all): the flag written by
    # torch-shaped code becomes the step's flag alone, as 0 or 1: skip and back-off agree on it.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = dscale.GradScaler("cpu", init_scale=2.0**8)
    scaler._read_host_flags = not decide_on_device
    scaler.scale(_loss(model, 0, False))  # no backward: every grad stays None
    state = scaler._per_optimizer_states[id(opt)]
    state["stage"] = OptState.UNSCALED
    state["found_inf_per_device"] = {torch.device("cpu"): torch.tensor(written)}
    scaler.step(opt)
    scaler.update()
    assert scaler.step_applied(opt) is not found
    assert scaler.get_scale() == (2.0**7 if found else 2.0**8)
    assert scaler.snapshot()["skipped_steps"] == int(found)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_flag_written_once_the_ranks_agreed_raises_at_once_and_changes_nothing() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**8)
    scaler.scale(_loss(model, 0, False)).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    flag = torch.tensor(1.0)
    with pytest.raises(RuntimeError, match="after the ranks agreed"):
        scaler._per_optimizer_states[id(opt)]["found_inf_per_device"] = {flag.device: flag}
    scaler.update()
    assert scaler.step_applied(opt)
    assert scaler.get_scale() == 2.0**8


def test_a_flag_written_with_no_check_before_update_is_a_clear_error_that_keeps_the_scale() -> None:
    """torch's update() reads such a flag as it is; dscale agrees on flags in the check, so it
    says so (an AssertionError from inside update() before) and the next iteration runs."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**8)
    scaler.scale(_loss(model, 0, False)).backward()
    flag = torch.tensor(1.0)
    scaler._per_optimizer_states[id(opt)]["found_inf_per_device"] = {flag.device: flag}
    with pytest.raises(RuntimeError, match=r"no step\(\) or unscale_\(\) checked"):
        scaler.update()
    assert scaler.get_scale() == 2.0**8
    scaler.scale(_loss(model, 1, False)).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.step_applied(opt)


def test_found_inf_per_device_between_unscale_and_step_reads_this_ranks_flag_as_torch() -> None:
    # A read between unscale_() and step() starts no agreement (it may come from one rank only,
    # see test_attach_iterations): it gives this rank's flag, and a flag written after it still
    # counts, as with torch's scaler (the oracle, same calls).
    runs = {}
    for kind in ("torch", "dscale"):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cls = torch.amp.GradScaler if kind == "torch" else dscale.GradScaler
        scaler = cls("cpu", init_scale=2.0**8)
        scaler.scale(_loss(model, 0, False)).backward()
        scaler.unscale_(opt)
        read = [float(f) for f in scaler._found_inf_per_device(opt).values()]
        flag = torch.tensor(1.0)
        scaler._per_optimizer_states[id(opt)]["found_inf_per_device"] = {flag.device: flag}
        reread = [float(f) for f in scaler._found_inf_per_device(opt).values()]
        scaler.step(opt)
        scaler.update()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        runs[kind] = (read, reread, scaler.get_scale(), params)
    assert runs["torch"][:3] == ([0.0], [1.0], 2.0**7)  # skipped and backed off
    assert runs["dscale"][:3] == runs["torch"][:3]
    assert torch.equal(runs["dscale"][3], runs["torch"][3])


def test_the_grad_scaler_keyword_is_read_from_the_step_in_use_each_time() -> None:
    # The signature is cached per step function: a step swapped on the instance (a wrapper, a
    # monkeypatch) between iterations must be read afresh, in both directions.
    seen: list[str] = []
    model = _model()
    opt = ReadsAttributes(model.parameters())
    plain_step = opt.step

    def passing(closure: Any = None, *, grad_scaler: Any = None) -> None:
        seen.append("grad_scaler" if grad_scaler is not None else "none")
        if grad_scaler is not None:
            grad_scaler._check_inf_per_device(opt)

    def reading(closure: Any = None) -> None:
        seen.append("attributes" if hasattr(opt, "found_inf") else "none")
        plain_step()

    scaler = dscale.GradScaler("cpu")
    for step in (reading, passing, reading, passing):
        opt.step = step  # type: ignore[method-assign]
        scaler.scale(_loss(model, 0, False)).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's, for grad_scaler=
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert seen == ["attributes", "grad_scaler", "attributes", "grad_scaler"]

    # A callable object as the step: its class's __call__ may be patched in place (mock.patch
    # does), so the same object must be read afresh too.
    class StepObject:
        def __call__(self, closure: Any = None, *, grad_scaler: Any = None) -> None:
            passing(grad_scaler=grad_scaler)

    opt.step = StepObject()  # type: ignore[method-assign]
    for patched in (False, True):
        if patched:
            StepObject.__call__ = lambda self, closure=None: reading()  # type: ignore[method-assign]
        scaler.scale(_loss(model, 0, False)).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert seen[4:] == ["grad_scaler", "attributes"]


def test_an_optimizer_passed_the_scaler_that_never_checks_is_an_error_naming_the_call() -> None:
    class Ignores(PassItself):
        def step(self, closure: Any = None, *, grad_scaler: Any = None) -> None:
            return None

    model = _model()
    opt = Ignores(model.parameters())
    scaler = dscale.GradScaler("cpu")
    scaler.scale(_loss(model, 0, False)).backward()
    with pytest.raises(RuntimeError, match=r"_check_inf_per_device\(optimizer\)"):
        scaler.step(opt)


def test_writes_to_other_private_keys_raise_and_torchs_factor_writes_are_honoured() -> None:
    scaler = dscale.GradScaler("cpu")
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(KeyError, match=r"stage.*found_inf_per_device"):
        scaler._per_optimizer_states[id(opt)]["retval"] = 1.0
    scaler._growth_factor = 4.0
    scaler._growth_interval = 7
    assert (scaler.get_growth_factor(), scaler.get_growth_interval()) == (4.0, 7)
    with pytest.raises(ValueError, match="growth"):
        scaler._growth_factor = 0.5
    # torch's scale before the first scale(): honoured then, refused (naming the call) after.
    ref = torch.amp.GradScaler("cpu")
    for s in (ref, scaler):
        s._init_scale = 1024.0
        s.scale(torch.ones(()))
    assert scaler.get_scale() == ref.get_scale() == 1024.0
    with pytest.raises(AttributeError, match=r"update\(new_scale"):
        scaler._init_scale = 8.0
    with pytest.raises(AttributeError, match="load_state_dict"):
        scaler._init_growth_tracker = 3


# ----------------------------------------------------------------- 2 gloo ranks


def _contracts_on_ranks(rank: int, world_size: int) -> dict:
    """Each contract with an inf on rank 1 only."""
    out: dict[str, Any] = {}
    for case, (make_opt, how) in CASES.items():
        model = _model()
        opt = make_opt(model.parameters())
        scaler = dscale.GradScaler("cpu", init_scale=2.0**8)
        for step in range(4):
            opt.zero_grad()
            found = step == 2 and rank == 1
            written = how == "flag_after_unscale"  # only rank 1 writes, once
            scaler.scale(_loss(model, step, found and not written)).backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                if how == "self_unscaled":
                    _self_unscaling_step(scaler, opt)
                elif written:
                    _flag_after_unscale(scaler, opt, found)
                else:
                    scaler.step(opt)
            scaler.update()
        out[case] = ([p.detach() for p in model.parameters()], scaler.get_scale())
    return out


def _agree(out: dict[int, dict]) -> None:
    for name in out[0]:
        (params0, scale0), (params1, scale1) = out[0][name], out[1][name]
        assert scale0 == scale1, name  # both ranks backed off together
        for a, b in zip(params0, params1, strict=True):
            assert torch.equal(a, b), name  # and skipped together


def test_every_contract_agrees_on_a_one_rank_inf() -> None:
    out = run_ranks(_contracts_on_ranks, timeout_s=180)
    _agree(out)
    for case in CASES:  # the skip happened: one back-off from 2**8, no growth in 4 steps
        assert out[0][case][1] == 2.0**7, case
