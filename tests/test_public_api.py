"""The public names are pinned: widening or narrowing the API is a visible, reviewed change."""

from __future__ import annotations

import inspect

import dscale

EXPECTED = [
    "FP16Optimizer",
    "GradObserver",
    "GradScaler",
    "ScaleCollapsedError",
    "StepGuard",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "prep_param_lists",
]


def test_dscale_all_is_pinned_and_sorted() -> None:
    assert dscale.__all__ == EXPECTED
    for name in EXPECTED:
        assert hasattr(dscale, name), name


def test_gradscaler_keeps_torch_positional_parameters_first() -> None:
    params = list(inspect.signature(dscale.GradScaler).parameters.values())
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == [
        "device",
        "init_scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "enabled",
    ]
    assert all(p.kind is p.KEYWORD_ONLY for p in params[len(positional) :])


def test_library_does_not_import_hydra_or_the_launcher() -> None:
    import subprocess
    import sys

    code = (
        "import sys, dscale, dscale.metrics, dscale.checkpoint, dscale.stats\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf', 'launch')]\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
