"""Every exported metric's value after scripted steps of a real GradScaler, on a fresh registry."""

from __future__ import annotations

import logging

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

import dscale
from dscale.metrics import ScalerCollector
from dscale.metrics._rank_check import RankScaleCheck
from dscale.stats import track_numerics

LABELS = {"rank": "3", "local_rank": "1", "node": "n7", "job_name": "unit"}

pytestmark = pytest.mark.filterwarnings("ignore:dscale.GradScaler. the loss's autograd graph")


def _train(scaler, model, opt, overflow: bool) -> None:
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()  # weight grad = scale * [1, 1, 1]
    if overflow:
        model.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()


@pytest.fixture
def scripted():
    """init 8, grow after 2 clean steps, min 2: clean, clean (grow to 16), then 3 overflows."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = dscale.GradScaler(device="cpu", init_scale=8.0, growth_interval=2, min_scale=2.0)
    stats = track_numerics(scaler, model, every=1, top_k=5)
    check = RankScaleCheck(every=1)  # single process: compares with itself, never a mismatch
    scaler.add_observer(check)
    registry = CollectorRegistry()
    registry.register(
        ScalerCollector(
            scaler,
            stats,
            labels=LABELS,
            min_scale=2.0,
            rank_check=check,
            build_info={"version": "0.1.0", "torch": "2.13.0"},
        )
    )
    return scaler, model, opt, registry


def _value(registry: CollectorRegistry, name: str, **extra: str) -> float | None:
    return registry.get_sample_value(name, {**LABELS, **extra})


def test_every_metric_after_growth_and_three_backoffs(scripted) -> None:
    scaler, model, opt, registry = scripted
    for overflow in (False, False, True, True, True):
        _train(scaler, model, opt, overflow)
    expected = {
        "dscale_loss_scale": 2.0,  # 8 -> 16 (growth) -> 8 -> 4 -> 2 (backoffs)
        "dscale_loss_scale_min": 2.0,
        "dscale_optimizer_steps_total": 5.0,
        "dscale_optimizer_steps_skipped_total": 3.0,
        "dscale_scale_growths_total": 1.0,
        "dscale_scale_backoffs_total": 3.0,
        "dscale_clean_steps_in_a_row": 0.0,
        "dscale_skipped_steps_in_a_row": 3.0,
        "dscale_rank_scale_mismatch_total": 0.0,
        "dscale_last_step_skipped": 1.0,
        # Last applied step was step 2, at scale 8: scaled norm 8*sqrt(3), unscaled sqrt(3).
        "dscale_grad_norm": 3**0.5,
        "dscale_grad_norm_scaled": 8 * 3**0.5,
        # Sampled at step 5 (every=1): no element of [inf, 2, 2] is below 2**-14.
        "dscale_underflow_fraction": 0.0,
    }
    got = {name: _value(registry, name) for name in expected}
    assert got == pytest.approx(expected)
    assert _value(registry, "dscale_nonfinite_grads_total", param="weight") == 3.0
    assert _value(registry, "dscale_nonfinite_grads_total", param="other") == 0.0
    info = _value(registry, "dscale_build_info", version="0.1.0", torch="2.13.0")
    assert info == 1.0


def test_values_are_read_at_scrape_time_not_at_registration(scripted) -> None:
    scaler, model, opt, registry = scripted
    assert _value(registry, "dscale_loss_scale") == 8.0
    _train(scaler, model, opt, overflow=False)
    _train(scaler, model, opt, overflow=False)
    assert _value(registry, "dscale_loss_scale") == 16.0
    assert _value(registry, "dscale_clean_steps_in_a_row") == 0.0
    _train(scaler, model, opt, overflow=False)
    assert _value(registry, "dscale_clean_steps_in_a_row") == 1.0
    assert _value(registry, "dscale_scale_growths_total") == 1.0


def test_exposition_has_no_created_series_and_every_series_carries_the_rank_labels(
    scripted,
) -> None:
    _, _, _, registry = scripted
    text = generate_latest(registry).decode()
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert samples
    assert not [s for s in samples if "_created" in s]
    for sample in samples:
        for key, value in LABELS.items():
            assert f'{key}="{value}"' in sample, sample


def test_without_stats_the_scaler_metrics_are_still_exported() -> None:
    scaler = dscale.GradScaler(device="cpu", init_scale=32.0)
    registry = CollectorRegistry()
    registry.register(ScalerCollector(scaler, labels=LABELS))
    assert _value(registry, "dscale_loss_scale") == 32.0
    assert _value(registry, "dscale_grad_norm") is None
    assert _value(registry, "dscale_loss_scale_min") is None


class _BrokenScaler:
    def snapshot(self, *, wait=True):
        raise RuntimeError("device lost")


def test_a_failing_scrape_logs_a_warning_and_reports_the_error(caplog) -> None:
    registry = CollectorRegistry()
    registry.register(ScalerCollector(_BrokenScaler(), labels=LABELS))
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="device lost"):
        generate_latest(registry)
    assert "scrape failed on rank 3" in caplog.text
    assert "training goes on" in caplog.text


def test_missing_labels_are_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"labels is missing \['node', 'job_name'\]"):
        ScalerCollector(_BrokenScaler(), labels={"rank": "0", "local_rank": "0"})
