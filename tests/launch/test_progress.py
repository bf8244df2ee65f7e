"""Rank 0's progress line: tokens/s after a resume; a word when ranks x threads exceed cores."""

from __future__ import annotations

import logging
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
    assert second.endswith("tokens/s 900"), second  # 9 steps x 1000 tokens in 10 s


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
