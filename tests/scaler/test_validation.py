"""Bad constructor arguments are ValueErrors that name the argument and the value."""

from __future__ import annotations

import pytest

import dscale


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"growth_factor": 1.0}, r"growth_factor must be a finite number > 1, got 1\.0"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"backoff_factor": 0.0}, r"backoff_factor must be in \(0, 1\), got 0\.0"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval must be an int >= 1, got 0"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"init_scale": float("inf")}, "init_scale must be a finite number > 0, got inf"),
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": -4.0}, "init_scale"),
        ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0}, "min_scale=8.0 is larger"),
        ({"min_scale": 8.0, "init_scale": 4.0}, "below min_scale"),
        ({"max_scale": 2.0, "init_scale": 4.0}, "above max_scale"),
        ({"hysteresis": 0}, "hysteresis must be an int >= 1"),
        ({"hysteresis_refill": "never"}, "hysteresis_refill"),
        ({"on_stuck_at_min": "ignore"}, "on_stuck_at_min"),
        ({"stuck_patience": 0}, "stuck_patience"),
    ],
)
def test_bad_argument_names_itself_and_its_value(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        dscale.GradScaler("cpu", **kwargs)


def test_cuda_scaler_without_cuda_warns_and_disables_itself_like_torch() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the scaler stays enabled")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = dscale.GradScaler("cuda")
    assert not scaler.is_enabled()
