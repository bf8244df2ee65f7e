"""The differential matrix, single process: dscale against torch's own skipping path, bit for bit.

Every optimizer in torch.optim, each implementation it has (for-loop, foreach, fused), with the
options that change how state is created, under four skip patterns, with ``sync_free`` off and on,
and with the decision taken on the host (the CPU path) and on the device (the CUDA path).
The reference is ``torch.amp.GradScaler`` with the same optimizer: a skipped step there is a step
that never ran. One exception, stated: torch's fused kernels still create state on a skipped first
step (fused SGD leaves its momentum buffer uninitialised), so a fused run whose first step is
skipped is compared with torch's for-loop run instead, within 1e-6 relative (fused and for-loop
kernels order their float operations differently; an uninitialised or zeroed buffer is off by far
more). Runtime: about 20 s on 2 cores shared with other jobs (load 4). The multi-rank topologies
are in test_matrix_ranks.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import dscale
from tests.scaler._setup import decide_on_device, decision_paths

pytestmark = pytest.mark.filterwarnings("ignore:dscale.GradScaler.*:UserWarning")

SKIP_PATTERNS = {"none": (), "first": (0,), "mid": (2,), "twice": (2, 3)}
STEPS = 5

# name -> (class, options that change state creation, implementations it has on the CPU)
_FOREACH = ("for-loop", "foreach")
_FUSED = ("for-loop", "foreach", "fused")
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], list[dict[str, Any]], tuple[str, ...]]] = {
    "SGD": (
        torch.optim.SGD,
        [
            {"lr": 0.1},
            {"lr": 0.1, "momentum": 0.9},
            {"lr": 0.1, "momentum": 0.9, "dampening": 0.5},
            {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
            {"lr": 0.1, "momentum": 0.9, "maximize": True},
        ],
        _FUSED,
    ),
    "Adam": (
        torch.optim.Adam,
        [{"lr": 0.01}, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.01}, {"maximize": True}],
        _FUSED,
    ),
    "AdamW": (torch.optim.AdamW, [{"lr": 0.01}, {"lr": 0.01, "amsgrad": True}], _FUSED),
    "Adagrad": (
        torch.optim.Adagrad,
        [{"lr": 0.1}, {"lr": 0.1, "initial_accumulator_value": 0.1, "weight_decay": 0.01}],
        _FUSED,
    ),
    "Adadelta": (torch.optim.Adadelta, [{"lr": 1.0}, {"weight_decay": 0.01}], _FOREACH),
    "Adafactor": (torch.optim.Adafactor, [{"lr": 0.01}, {"maximize": True}], _FOREACH[:1]),
    "Adamax": (torch.optim.Adamax, [{"lr": 0.01}, {"weight_decay": 0.01}], _FOREACH),
    "ASGD": (torch.optim.ASGD, [{"lr": 0.01}, {"lr": 0.01, "t0": 1.0}], _FOREACH),
    "NAdam": (torch.optim.NAdam, [{"lr": 0.01}, {"decoupled_weight_decay": True}], _FOREACH),
    "RAdam": (torch.optim.RAdam, [{"lr": 0.01}, {"weight_decay": 0.01}], _FOREACH),
    "RMSprop": (
        torch.optim.RMSprop,
        [{"lr": 0.01}, {"lr": 0.01, "momentum": 0.9, "centered": True}],
        _FOREACH,
    ),
    "Rprop": (torch.optim.Rprop, [{"lr": 0.01}, {"maximize": True}], _FOREACH),
    "Muon": (torch.optim.Muon, [{"lr": 0.01}, {"lr": 0.01, "nesterov": False}], ("for-loop",)),
}
# Not in the matrix, with the reason: LBFGS needs a closure (refused by every GradScaler while
# enabled); SparseAdam takes sparse grads only: test_sparse_grads_skip_and_unscale_as_torch_does.
NOT_COVERED = {"LBFGS", "SparseAdam", "Optimizer"}


def _impl_kwargs(impl: str) -> dict[str, Any]:
    return {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[
        impl
    ]


def _make(name: str, options: dict[str, Any], impl: str) -> Callable[[Any], torch.optim.Optimizer]:
    cls = OPTIMIZERS[name][0]
    kwargs = {**options, **(_impl_kwargs(impl) if name != "Muon" else {})}
    if name == "Adafactor":
        kwargs.pop("foreach")  # Adafactor has no foreach kernel on the CPU
    return lambda params: cls(params, **kwargs)


LATE_FROM = 2  # the step from which the "late" parameter gets a grad


def _run(
    scaler: Any,
    make_opt,
    skips: tuple[int, ...],
    *,
    matrices_only: bool = False,
    frozen_and_late: bool = False,
):
    """``frozen_and_late``: the optimizer also holds a frozen parameter (never a grad, so never
    any state) and one that gets its first grad at step LATE_FROM (its state created mid-run,
    by a skipped step under the "mid" and "twice" patterns)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    params = [p for p in model.parameters() if p.dim() == 2 or not matrices_only]
    frozen = nn.Parameter(torch.randn(3, 2), requires_grad=False)
    late = nn.Parameter(torch.randn(2, 3))
    if frozen_and_late:
        params = [params[0], frozen, *params[1:], late]
    opt = make_opt(params)
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        opt.zero_grad()
        loss = model(torch.randn(4, 6)).square().mean()
        if frozen_and_late and step >= LATE_FROM:
            loss = loss + (late * 0.1).square().sum()
        scaler.scale(loss * (float("inf") if step in skips else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
    state = [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
        for p in params
        if p in opt.state
    ]
    return [p.detach().clone() for p in params], state, scaler.get_scale()


def _cases():
    for name, (_, option_list, impls) in OPTIMIZERS.items():
        for options, impl, pattern in itertools.product(option_list, impls, SKIP_PATTERNS):
            yield name, options, impl, pattern


def _assert_same(ours, ref, exact: bool, what: str) -> None:
    (p_ours, s_ours, scale_ours), (p_ref, s_ref, scale_ref) = ours, ref
    assert scale_ours == scale_ref, what
    for a, b in zip(p_ours, p_ref, strict=True):
        if exact:
            assert torch.equal(a, b), f"{what}: parameters differ"
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=what)
    assert [sorted(s) for s in s_ours] == [sorted(s) for s in s_ref], f"{what}: state keys"
    assert len(s_ours) == len(s_ref), f"{what}: state created for a different set of parameters"
    for s, t in zip(s_ours, s_ref, strict=True):
        for key in s:
            a, b = s[key], t[key]
            if not torch.is_tensor(a):
                assert a == b, f"{what}: state {key!r}"
            elif exact:
                assert torch.equal(a.float(), b.float()), f"{what}: state {key!r}"
            else:
                torch.testing.assert_close(a.float(), b.float(), rtol=1e-6, atol=1e-7, msg=what)


def test_the_matrix_covers_every_torch_optimizer() -> None:
    names = {
        n
        for n in torch.optim.__all__
        if isinstance(getattr(torch.optim, n), type)
        and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
    }
    assert names == set(OPTIMIZERS) | NOT_COVERED


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_dscale_equals_torch_skipping_for_every_implementation_option_and_skip_pattern(name):
    failures = []
    for _, options, impl, pattern in (c for c in _cases() if c[0] == name):
        skips = SKIP_PATTERNS[pattern]
        matrices = name == "Muon"  # Muon takes 2-D parameters only
        fused_first = impl == "fused" and 0 in skips
        ref_impl = "for-loop" if fused_first else impl
        ref = _run(
            torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2),
            _make(name, options, ref_impl),
            skips,
            matrices_only=matrices,
        )
        for sync_free, on_device in decision_paths(impl == "fused"):
            what = f"{name} {options} {impl} skip={pattern} sync_free={sync_free} {on_device=}"
            scaler = dscale.GradScaler(
                "cpu", init_scale=2.0**8, growth_interval=2, sync_free=sync_free
            )
            if on_device:
                decide_on_device(scaler)
            try:
                ours = _run(scaler, _make(name, options, impl), skips, matrices_only=matrices)
                _assert_same(ours, ref, exact=not fused_first, what=what)
            except AssertionError as exc:
                failures.append(str(exc).splitlines()[0])
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_device_decisions_equal_torch_skipping_with_a_frozen_and_a_late_parameter(name) -> None:
    """Issue 33 item 4: ``sync_free``'s flat snapshot holds parameters without state (frozen,
    not yet trained, or an optimizer that keeps none); a skip must still equal no step, and
    state a skipped step created mid-run must go. Fused optimizers (their own device path,
    the neighbour) too: torch's fused kernels create state on a skipped state-creating step, so
    where one is skipped (step 0, or the late parameter's first) the reference is torch's
    for-loop run, within 1e-6 as in the matrix above. The device decision only: the paths this
    concerns."""
    failures = []
    for _, options, impl, pattern in (c for c in _cases() if c[0] == name):
        if name == "SGD" and impl == "fused" and options.get("momentum"):
            # torch 2.13's fused SGD itself raises (TypeError in _fused_sgd_) when a parameter's
            # first grad comes after the others' momentum buffers exist, with or without a scaler.
            continue
        skips = SKIP_PATTERNS[pattern]
        kwargs = {"matrices_only": name == "Muon", "frozen_and_late": True}
        creating_skipped = impl == "fused" and bool({0, LATE_FROM} & set(skips))
        ref = _run(
            torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2),
            _make(name, options, "for-loop" if creating_skipped else impl),
            skips,
            **kwargs,
        )
        scaler = decide_on_device(
            dscale.GradScaler(
                "cpu", init_scale=2.0**8, growth_interval=2, sync_free=impl != "fused"
            )
        )
        try:
            _assert_same(
                _run(scaler, _make(name, options, impl), skips, **kwargs),
                ref,
                exact=not creating_skipped,
                what=f"{options} {impl} {pattern}",
            )
        except AssertionError as exc:
            failures.append(str(exc).splitlines()[0])
    assert not failures, "\n".join(failures)


class _IntStepSGD(torch.optim.Optimizer):
    """A third-party style optimizer: a Python int step, and a momentum buffer it rebinds."""

    def __init__(self, params, lr=0.1, int_step=True):
        super().__init__(params, {"lr": lr})
        self.int_step = int_step

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0 if self.int_step else torch.tensor(0.0)
                    state["buf"] = p.grad.clone()
                else:
                    state["buf"] = 0.9 * state["buf"] + p.grad  # rebinds, never in place
                state["step"] += 1
                p.add_(state["buf"], alpha=-group["lr"] / float(state["step"]) ** 0.5)


@pytest.mark.parametrize("pattern", sorted(SKIP_PATTERNS))
def test_sync_free_is_exact_for_an_optimizer_that_rebinds_its_state(pattern) -> None:
    make = lambda p: _IntStepSGD(p, int_step=False)  # noqa: E731
    skips = SKIP_PATTERNS[pattern]
    ref = _run(torch.amp.GradScaler("cpu", init_scale=2.0**8), make, skips)
    scaler = decide_on_device(dscale.GradScaler("cpu", init_scale=2.0**8, sync_free=True))
    ours = _run(scaler, make, skips)
    _assert_same(ours, ref, exact=True, what=pattern)


def test_sync_free_refuses_a_python_int_step_at_the_first_step() -> None:
    scaler = decide_on_device(dscale.GradScaler("cpu", sync_free=True))
    with pytest.raises(ValueError, match=r"_IntStepSGD: its state 'step' is a Python int"):
        _run(scaler, lambda p: _IntStepSGD(p, int_step=True), ())


class _TorchAllowingFp16(torch.amp.GradScaler):
    """torch's scaler with its fp16-grad path on (ShardedGradScaler's): the fp16 oracle."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


def _sparse_run(scaler: Any, make_opt, dtype: torch.dtype) -> list[Any]:
    """A sparse embedding's grads set by hand, so one step can carry duplicate indices."""
    weight = nn.Parameter(torch.linspace(-1.0, 1.0, 40).reshape(10, 4).to(dtype))
    opt = make_opt([weight])
    scale = 2.0**8
    history = []
    for step in range(5):
        rows = [[1, 3, 3, 7]]  # row 3 twice: coalescing adds the two
        values = torch.full((4, 4), 0.25 * (step + 1))
        if step == 2:  # fp16: 200 * 256 each, finite; summed on coalescing, past fp16's max
            values[1:3] = 200.0
        if step == 3:
            values[0, 0] = float("inf")
        scaler.scale(torch.ones(()))  # the scale exists from the first backward on
        weight.grad = torch.sparse_coo_tensor(rows, (values * scale).to(dtype), (10, 4))
        scaler.step(opt)
        scaler.update()
        scale = scaler.get_scale()
        history.append((weight.detach().clone(), scale))
    return history


@pytest.mark.parametrize(
    ("make_opt", "dtype"),
    [
        (lambda p: torch.optim.SparseAdam(p, lr=0.01), torch.float32),
        (lambda p: torch.optim.Adagrad(p, lr=0.1), torch.float32),
        (lambda p: torch.optim.SGD(p, lr=0.1), torch.float32),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), torch.float32),
        (lambda p: torch.optim.SGD(p, lr=0.1), torch.float16),  # the others refuse fp16 params
    ],
    ids=["SparseAdam", "Adagrad", "SGD", "SGD-momentum", "SGD-fp16"],
)
@pytest.mark.parametrize(("sync_free", "on_device"), decision_paths(fused=False))
def test_sparse_grads_skip_and_unscale_as_torch_does(make_opt, dtype, sync_free, on_device):
    """Sparse grads are checked by their values, fp16 ones once coalesced (duplicates add up).
    ``sync_free`` on the device too: SGD's momentum buffer for sparse grads is a sparse tensor,
    which no device op can mask (``torch.where`` raised NotImplementedError after the skipped
    step had been applied)."""
    optimizer = make_opt([nn.Parameter(torch.zeros(1))])
    if dtype is torch.float16 and optimizer.__class__ is not torch.optim.SGD:
        pytest.skip("SparseAdam and Adagrad refuse fp16 parameters on the CPU")
    if sync_free and isinstance(optimizer, torch.optim.SparseAdam):
        pytest.skip("SparseAdam keeps a Python int step, which sync_free refuses at the first step")
    want = _sparse_run(_TorchAllowingFp16("cpu", init_scale=2.0**8), make_opt, dtype)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**8, sync_free=sync_free)
    if on_device:
        decide_on_device(scaler)
    got = _sparse_run(scaler, make_opt, dtype)
    for step, ((w_want, s_want), (w_got, s_got)) in enumerate(zip(want, got, strict=True)):
        assert s_got == s_want, step
        assert torch.equal(w_got, w_want), step
    skipped = [step for step in range(1, 5) if want[step][1] < want[step - 1][1]]
    assert skipped == ([2, 3] if dtype is torch.float16 else [3])
