"""A StepGuard run's progress lines and summary show what a guard has, not ``scale 1``."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dscale
from dscale.stats import track_numerics
from launch.progress import RankZeroProgress
from launch.summary import build_summary, format_summary


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "launch.progress"]


def _train(scaler: dscale.GradScaler, steps: int, *, spike_at: int | None = None):
    """A few steps of a linear model; returns (stats, the last applied step's grad norm)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    stats = track_numerics(scaler, model)
    applied_norm = None
    for step in range(steps):
        x = torch.randn(16, 8) * (1e4 if step == spike_at else 1.0)
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        # The oracle: torch's own norm of this step's (unscaled) grads.
        norm = (
            torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()])
            )
            / scaler.get_scale()
        )
        scaler.step(opt)
        scaler.update()
        if scaler.step_applied:
            applied_norm = float(norm)
        opt.zero_grad()
    return stats, applied_norm


def test_a_step_guards_progress_line_shows_skips_spikes_and_grad_norm_not_scale_1(
    caplog: pytest.LogCaptureFixture,
) -> None:
    guard = dscale.StepGuard("cpu", spike_signals=("loss",), spike_warmup=4, spike_window=8)
    stats, applied_norm = _train(guard, 12, spike_at=10)
    assert guard.snapshot()["spike_skipped_steps"] == 1  # the spike at step 10 was skipped
    record = SimpleNamespace(num_skipped=1)  # the launcher's record: every skipped step
    bar = RankZeroProgress(12, 4, guard, record)  # type: ignore[arg-type]
    bar._bar = False
    bar.stats = stats
    with caplog.at_level(logging.INFO, logger="launch.progress"):
        bar.update(11, 0.5)
    (line,) = _lines(caplog)
    assert "scale" not in line, line
    assert line.endswith(f"loss 0.5000 skipped 1 spikes 1 grad norm {applied_norm:.4g}"), line


def test_a_loss_scalers_progress_line_still_shows_its_scale(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scaler = dscale.GradScaler("cpu", init_scale=1024.0)
    stats, _ = _train(scaler, 3)
    bar = RankZeroProgress(3, 1, scaler, SimpleNamespace(num_skipped=0))  # type: ignore[arg-type]
    bar._bar = False
    bar.stats = stats
    with caplog.at_level(logging.INFO, logger="launch.progress"):
        bar.update(2, 0.5)
    assert _lines(caplog)[0].endswith(f"scale {scaler.get_scale():g} skipped 0")


def _rank(rank: int, **fields: object) -> dict[str, object]:
    return {
        "rank": rank,
        "final_scale": 1.0,
        "steps": 40,
        "skipped_steps": [10, 30],
        "num_skipped": 2,
        "resumed_from": None,
        "attempt": 0,
        "result": None,
        **fields,
    }


def test_a_guard_runs_summary_says_no_loss_scaling_instead_of_final_scale_1() -> None:
    ranks = [_rank(r, loss_scaling=False, num_spike_skipped=1) for r in (0, 1)]
    text = format_summary(build_summary(ranks, run_dir=Path("/r"), what={"entrypoint": "m:f"}))
    assert "final scale" not in text, text
    assert "rank 1: 2 skipped steps [10, 30] (1 of them spikes), no loss scaling" in text, text
    fp16 = [_rank(r, final_scale=16384.0, loss_scaling=True) for r in (0, 1)]
    text = format_summary(build_summary(fp16, run_dir=Path("/r"), what={"entrypoint": "m:f"}))
    assert "rank 0: final scale 16384, 2 skipped steps [10, 30]" in text, text


@pytest.mark.slow
def test_a_bf16_job_prints_skips_spikes_and_grad_norm_and_its_report_has_no_scale_panel(
    tmp_path: Path,
) -> None:
    """docs/bf16.md's launcher line, end to end: 2 ranks, an inf on rank 1 at step 4."""
    from launch_helpers import FAST, free_port_pair, launch, output, summary

    from dscale.report import figure

    proc = launch(
        tmp_path,
        *FAST,
        "trainer.precision=bf16",
        "scaler.spike_signals=[loss]",
        "model=mlp",
        "trainer.max_steps=10",
        "fault.inf_steps=[4]",
        "fault.inf_rank=1",
        f"metrics.port={free_port_pair()}",
    )
    assert proc.returncode == 0, output(proc)
    printed = proc.stdout + proc.stderr
    assert "scale 1" not in printed and "final scale" not in printed, output(proc)
    assert "step 10/10 loss " in printed and " skipped 1 spikes 0 grad norm " in printed, printed
    assert "rank 1: 1 skipped steps [4] (0 of them spikes), no loss scaling" in printed, printed
    s = summary(tmp_path)
    assert [(r["loss_scaling"], r["skipped_steps"]) for r in s["ranks"]] == [(False, [4])] * 2
    labels = [ax.get_ylabel().split("\n")[0] for ax in figure(tmp_path).axes]
    assert "loss scale" not in labels and "grad norm" in labels, labels
