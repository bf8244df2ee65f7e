"""``python -m dscale.bench fp8``: a short run reports every arm with the issue's fields.

Counts are deterministic, so the smoke run checks them: one all-reduce per step for dscale's
arm, two for torchao's precompute, no saturated weight element in dscale's arm.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("predict", ["bound", "exact"])
def test_short_fp8_benchmark_reports_every_arm(tmp_path, predict):
    out = tmp_path / "fp8.json"
    cmd = [sys.executable, "-m", "dscale.bench", "fp8", "--steps", "4", "--models", "mlp"]
    cmd += ["--predict", predict]
    proc = subprocess.run(
        [*cmd, "--no-sweep", "--json", str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["predict"] == predict
    arms = result["arms"]["mlp"]
    assert set(arms) == {"hp", "torchao", "dscale"}
    for arm in arms.values():
        assert {"collectives_per_step", "saturated_weight_elements", "min_scale_ratio"} <= set(arm)
        assert "final_loss" in arm
    assert arms["dscale"]["collectives_per_step"] == 1
    assert arms["torchao"]["collectives_per_step"] == 2
    assert arms["dscale"]["saturated_weight_elements"] == 0
    assert arms["dscale"]["scales_equal_across_ranks"]
    assert result["telemetry"]["extra_ops_unsampled"] == 0
    assert result["telemetry"]["extra_ops_sampled"] > 0
    assert "dscale" in proc.stdout
    # The profiler that counts the ops printed 23 kineto lines per run ("USDT:... profiler_start").
    assert "profiler_start" not in proc.stderr + proc.stdout, proc.stderr[-2000:]


def test_fallback_arm_reports_switched_layers_and_loss_gaps(tmp_path):
    out = tmp_path / "fp8.json"
    cmd = [sys.executable, "-m", "dscale.bench", "fp8", "--steps", "3", "--models", "mlp"]
    proc = subprocess.run(
        [*cmd, "--no-sweep", "--fallback", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["fallback"] is True
    arms = result["arms"]["mlp"]
    assert set(arms) == {"hp", "torchao", "dscale", "fallback"}
    fb = arms["fallback"]["fallback"]
    assert {"switched", "passed_but_left", "agreed_on_ranks", "layers"} <= set(fb)
    assert (fb["threshold"], fb["samples"]) == (0.01, 3)  # Float8Fallback's defaults
    assert fb["samples_taken"] == 1  # step 0 of 3, every 10
    assert fb["agreed_on_ranks"]
    assert 0.0 <= fb["largest_share_sampled"]["share"] <= 1.0
    assert len(fb["layers"]) == arms["fallback"]["float8_layers"]
    for arm in ("torchao", "dscale", "fallback"):
        gap = arms[arm]["final_loss"] - arms["hp"]["final_loss"]
        assert arms[arm]["loss_gap_to_hp"] == pytest.approx(gap)
    # the fallback's numerics ride the one collective: still one all-reduce per step
    assert arms["fallback"]["collectives_per_step"] == 1
    assert "fallback" in proc.stdout


def test_fallback_arm_reports_a_layer_that_passed_and_was_left_on_both_ranks(tmp_path):
    """Any non-zero share passes a 1e-9 threshold on step 0's sample; with float8 all-gather
    (every layer of the benchmark) the fallback leaves the layer in FP8, and says so."""
    out = tmp_path / "fp8.json"
    cmd = [sys.executable, "-m", "dscale.bench", "fp8", "--steps", "2", "--models", "mlp"]
    cmd += ["--no-sweep", "--fallback", "--fallback-threshold", "1e-9", "--fallback-samples", "1"]
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fb = json.loads(out.read_text())["arms"]["mlp"]["fallback"]["fallback"]
    assert (fb["threshold"], fb["samples"]) == (1e-9, 1)
    assert fb["switched"] == []
    assert fb["passed_but_left"], fb  # at least one layer had a non-zero share at step 0
    assert {r["after_step"] for r in fb["passed_but_left"]} == {1}
    assert {r["layer"] for r in fb["passed_but_left"]} <= set(fb["layers"])
    assert fb["agreed_on_ranks"]
    assert "stays in FP8" in proc.stderr  # Float8Fallback's warning


def test_bad_fallback_threshold_is_refused_before_any_rank_starts():
    cmd = [sys.executable, "-m", "dscale.bench", "fp8", "--fallback", "--fallback-threshold", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--fallback-threshold must be in (0, 1) (got 2.0)" in proc.stderr
