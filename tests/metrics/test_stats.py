"""NumericsStats: norms, non-finite attribution, underflow sampling, no host reads when hot."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import dscale
from dscale.stats import FP16_MIN_NORMAL, NumericsStats, track_numerics

pytestmark = pytest.mark.filterwarnings("ignore:dscale.GradScaler. the loss's autograd graph")

SCALE = torch.tensor(1024.0)
CLEAN = torch.tensor(0.0)
OVERFLOW = torch.tensor(1.0)


def _params(*shapes: tuple[int, ...]) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"p{i}", torch.nn.Parameter(torch.zeros(s))) for i, s in enumerate(shapes)]


def _set_grads(params, *grads: torch.Tensor) -> list[torch.Tensor]:
    for (_, p), g in zip(params, grads, strict=True):
        p.grad = g.clone()
    return [p.grad for _, p in params]


def _step(stats: NumericsStats, params, found_inf: torch.Tensor, *grads: torch.Tensor) -> None:
    stats.on_grads(None, _set_grads(params, *grads), SCALE)
    stats.on_update(None, found_inf)


@contextlib.contextmanager
def _host_reads_forbidden(monkeypatch: pytest.MonkeyPatch):
    """Make every tensor-to-host read raise: on GPU each of these would be a sync."""

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a tensor on the hot path")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "numpy"):
            m.setattr(torch.Tensor, name, forbidden)
        yield


def test_grad_norm_is_the_global_norm_before_and_after_unscaling() -> None:
    params = _params((2,), (3,))
    stats = NumericsStats(params)
    _step(stats, params, CLEAN, torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0, 12.0]))
    snap = stats.read()
    assert snap.grad_norm_scaled == pytest.approx(13.0)
    assert snap.grad_norm == pytest.approx(13.0 / 1024)
    assert snap.last_step_skipped is False


def test_an_overflow_step_keeps_the_last_applied_norm_and_counts_the_offending_params() -> None:
    params = _params((2,), (2,), (2,))
    stats = NumericsStats(params)
    _step(stats, params, CLEAN, torch.tensor([3.0, 4.0]), torch.zeros(2), torch.zeros(2))
    inf, nan = float("inf"), float("nan")
    _step(stats, params, OVERFLOW, torch.tensor([inf, 1.0]), torch.zeros(2), torch.tensor([nan, 0]))
    snap = stats.read()
    assert snap.grad_norm_scaled == pytest.approx(5.0)
    assert snap.last_step_skipped is True
    assert snap.nonfinite_grads == {"p0": 1, "p2": 1, "other": 0}


def test_an_update_without_grads_keeps_the_last_norm() -> None:
    # With scaler.attach() the hook handles the grads and observers may see none.
    params = _params((2,))
    stats = NumericsStats(params)
    _step(stats, params, CLEAN, torch.tensor([3.0, 4.0]))
    stats.on_grads(None, [], SCALE)
    stats.on_update(None, CLEAN)
    assert stats.read().grad_norm_scaled == pytest.approx(5.0)
    assert stats.read().steps_observed == 2


def test_nonfinite_grads_are_not_counted_when_the_agreed_flag_says_clean() -> None:
    # A finite-but-huge fp32 grad can overflow its own norm; only agreed overflow steps count.
    params = _params((2,))
    stats = NumericsStats(params)
    _step(stats, params, CLEAN, torch.tensor([float("inf"), 0.0]))
    _step(stats, params, CLEAN, torch.tensor([1.0, 0.0]))
    assert stats.read().nonfinite_grads == {"other": 0}


def test_top_k_names_are_sticky_and_the_rest_goes_to_other() -> None:
    params = _params((1,), (1,), (1,))
    stats = NumericsStats(params, top_k=1)
    inf, ok = torch.tensor([float("inf")]), torch.tensor([1.0])
    _step(stats, params, OVERFLOW, ok, inf, ok)  # p1 overflows first and takes the one slot
    assert stats.read().nonfinite_grads == {"p1": 1, "other": 0}
    for _ in range(3):
        _step(stats, params, OVERFLOW, inf, ok, inf)  # p0 and p2 overflow more often later
    assert stats.read().nonfinite_grads == {"p1": 1, "other": 6}


def test_grads_that_match_no_parameter_count_as_other() -> None:
    params = _params((1,))
    stats = NumericsStats(params)
    stray = torch.tensor([float("inf")])
    stats.on_grads(None, [stray], SCALE)
    stats.on_update(None, OVERFLOW)
    assert stats.read().nonfinite_grads == {"other": 1}


def test_underflow_fraction_is_sampled_every_n_steps_from_the_scaled_grads() -> None:
    params = _params((4,))
    stats = NumericsStats(params, underflow_every=2)
    tiny = FP16_MIN_NORMAL / 2
    # step 0 is sampled: 0 and tiny are under fp16's min normal, 1.0 and 2**-14 itself are not.
    _step(stats, params, CLEAN, torch.tensor([0.0, tiny, 1.0, FP16_MIN_NORMAL]))
    assert stats.read().underflow_fraction == pytest.approx(0.5)
    _step(stats, params, CLEAN, torch.zeros(4))  # step 1: not sampled, value unchanged
    assert stats.read().underflow_fraction == pytest.approx(0.5)
    _step(stats, params, CLEAN, torch.tensor([0.0, 1.0, 1.0, 1.0]))  # step 2: sampled
    assert stats.read().underflow_fraction == pytest.approx(0.25)


def test_underflow_is_nan_until_sampled_and_never_with_every_zero() -> None:
    params = _params((2,))
    stats = NumericsStats(params, underflow_every=0)
    _step(stats, params, CLEAN, torch.zeros(2))
    assert math.isnan(stats.read().underflow_fraction)


def test_the_hot_path_never_reads_a_tensor_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    params = _params((2,), (3,))
    stats = NumericsStats(params, underflow_every=1)
    grads = _set_grads(params, torch.tensor([1.0, float("inf")]), torch.ones(3))
    with _host_reads_forbidden(monkeypatch):
        for flag in (OVERFLOW, CLEAN):
            stats.on_grads(None, grads, SCALE)
            stats.on_update(None, flag)
    assert stats.read().nonfinite_grads == {"p0": 1, "other": 0}


def test_stats_follow_a_real_grad_scaler() -> None:
    model = torch.nn.Linear(3, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = dscale.GradScaler(device="cpu", init_scale=4.0, growth_interval=100)
    stats = track_numerics(scaler, model, every=1)
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()  # grad of the weight: 4 * [1, 1, 1]
    scaler.step(opt)
    scaler.update()
    snap = stats.read()
    assert snap.grad_norm_scaled == pytest.approx(4.0 * math.sqrt(3))
    assert snap.grad_norm == pytest.approx(math.sqrt(3))
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    model.weight.grad[0, 1] = float("nan")
    scaler.step(opt)
    scaler.update()
    snap = stats.read()
    assert snap.last_step_skipped is True
    assert snap.nonfinite_grads == {"weight": 1, "other": 0}
    assert snap.steps_observed == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"underflow_every": -1}, "underflow_every must be an int >= 0, got -1"),
        ({"top_k": 0}, "top_k must be an int >= 1, got 0"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        NumericsStats(_params((1,)), **kwargs)


def test_no_parameters_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="named_parameters is empty"):
        NumericsStats([])
