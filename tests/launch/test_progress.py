"""Rank 0's progress line: tokens/s after a resume; a word when ranks x threads exceed cores."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

import launch.elastic as elastic
import launch.progress as progress
from launch.progress import RankZeroProgress


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "launch.progress"]


def test_first_tokens_per_second_after_a_resume_counts_only_the_steps_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = iter([100.0, 110.0])  # setup took long; the loop resumed at step 50, then 10 steps/10 s
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    scaler = SimpleNamespace(get_scale=lambda: 8192.0)
    bar = RankZeroProgress(60, 10, scaler, SimpleNamespace(num_skipped=0))  # type: ignore[arg-type]
    bar._bar = False
    with caplog.at_level(logging.INFO, logger="launch.progress"):
        bar.update(50, 2.0, tokens=1000)  # the first step after the resume
        bar.update(59, 1.9, tokens=1000)
    first, second = _lines(caplog)
    # Old code counted 51 steps (from step -1) into the first line's tokens/s.
    assert "tokens/s" not in first, first
    assert "tokens/s 900 " in second, second  # 9 steps x 1000 tokens in 10 s


def test_the_progress_line_shows_its_per_second_and_eta_and_every_rank_keeps_the_figures(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = iter([100.0, 110.0, 100.0, 110.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    scaler = SimpleNamespace(get_scale=lambda: 8192.0)
    bar = RankZeroProgress(300, 10, scaler, SimpleNamespace(num_skipped=0))  # type: ignore[arg-type]
    bar._bar = False
    with caplog.at_level(logging.INFO, logger="launch.progress"):
        bar.update(49, 2.0, tokens=1000)
        bar.update(99, 1.5, tokens=1000)  # 50 steps in 10 s; 200 steps left
    assert _lines(caplog)[1].endswith("tokens/s 5,000 it/s 5.0 ETA 40s"), _lines(caplog)
    # What /metrics serves (rank-local, host numbers), on rank 0 and on a silent rank alike.
    quiet = progress.Progress(300, 10, scaler, SimpleNamespace(num_skipped=0))  # type: ignore[arg-type]
    quiet.update(49, 2.0, tokens=1000)
    quiet.update(99, 1.5, tokens=1000)
    for figures in (bar.figures, quiet.figures):
        assert figures.values() == {
            "dscale_train_step": 99.0,
            "dscale_train_loss": 1.5,
            "dscale_train_tokens_per_second": 5000.0,
            "dscale_train_step_seconds": 0.2,
        }


def test_ranks_times_threads_over_the_cores_is_warned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(elastic, "cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(elastic.RUN_DIR_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="launch.elastic"):
        elastic.worker_env(6)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "6 local ranks x 1 threads" in warning and "2 cores" in warning, warning
    caplog.clear()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with caplog.at_level(logging.WARNING, logger="launch.elastic"):
        elastic.worker_env(2)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.slow
def test_a_launched_job_logs_its_loss_and_the_report_draws_it(tmp_path: Path) -> None:
    from launch_helpers import FAST, free_port_pair, launch, output

    from dscale.report import figure

    proc = launch(
        tmp_path, *FAST, "trainer.max_steps=10", f"metrics.port={free_port_pair()}", timeout_s=240
    )
    assert proc.returncode == 0, output(proc)
    text = (tmp_path / "metrics" / "loss-rank0.jsonl").read_text()  # old code: no such file
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["step"] for r in rows] == [0, 4, 9]  # the progress lines' steps (log_every=5)
    assert all(r["loss"] > 0 for r in rows)
    ax_loss = figure(tmp_path).axes[0]
    assert ax_loss.get_ylabel().startswith("loss")
    # The demo notes every step's loss in the metrics log (old code: the 3 progress points).
    assert list(ax_loss.get_lines()[0].get_xdata()) == list(range(10))
