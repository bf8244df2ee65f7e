"""The report of a StepGuard (bf16 / FP8) run: no flat scale panels; grad norm, band, skips."""

from __future__ import annotations

import json
import math

import matplotlib.collections
import pytest
import torch

import dscale
from dscale.metrics import MetricsLog
from dscale.report import figure, read_metrics_log
from dscale.stats import track_numerics


def _guard_run(run_dir, steps: int, spikes: set[int]) -> dscale.StepGuard:
    """A bf16 StepGuard with a spike gate on the loss; a loss spike at each step in ``spikes``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = dscale.StepGuard("cpu", spike_signals=("loss",), spike_warmup=6, spike_window=10)
    stats = track_numerics(guard, model)
    log = MetricsLog(run_dir, stats=stats, rank=0, every=4)
    guard.add_observer(log)
    for step in range(steps):
        x = torch.randn(16, 8) * (30.0 if step in spikes else 1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        log.note_loss(loss)
        guard.scale(loss).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
    log.close()
    return guard


def test_a_guard_runs_report_shows_loss_and_grad_norm_with_the_spike_band_not_scale_1(
    tmp_path,
) -> None:
    guard = _guard_run(tmp_path, 40, spikes={20, 33})
    rows = read_metrics_log(tmp_path)[0]
    skipped = {r["step"] for r in rows if r["skipped"]}
    assert skipped == {20, 33} and guard.snapshot()["spike_skipped_steps"] == 2
    fig = figure(tmp_path)
    labels = [ax.get_ylabel().split("\n")[0] for ax in fig.axes]
    assert labels == ["loss", "grad norm"], labels  # old report: loss scale, skipped steps too
    title = fig.texts[0].get_text()
    assert "scale 1 -> 1" not in title and "no loss scaling (step guard)" in title, title
    assert "2 skipped" in title and "spike gate on loss (6 sigma, window 10)" in title, title
    ax_loss, ax_norm = fig.axes
    for ax in (ax_loss, ax_norm):  # the skipped steps are marked on both panels
        marked = {
            float(p[0])
            for c in ax.collections
            if not isinstance(c, matplotlib.collections.PolyCollection)
            for p in c.get_offsets()
        }
        assert marked == {20.0, 33.0}, ax.get_ylabel()
    (drawn,) = [
        c
        for c in ax_loss.collections
        if isinstance(c, matplotlib.collections.FillBetweenPolyCollection)
    ]
    assert "spike band" in drawn.get_label()
    assert all(r["loss_scaling"] is False for r in rows)
    assert rows[0]["spike"] == {"signals": ["loss"], "sigma": 6.0, "window": 10, "warmup": 6}
    from dscale.report import spike_band

    # The oracle is the gate itself: the band drawn says "skip" exactly where the gate skipped.
    band = spike_band(rows, "loss", sigma=6.0, window=10, warmup=6)
    assert [s for s, _, _ in band] == list(range(6, 40))
    losses = {r["step"]: r["loss"] for r in rows}
    assert {s for s, _, upper in band if losses[s] > upper} == skipped


def _write_fp8_run(run_dir) -> dict[str, dict[str, float]]:
    """A two-rank FP8 log by hand: 8 steps, samples at 0 and 4, a resume at 4."""
    (run_dir / "metrics").mkdir()
    names = ("amax", "scale", "saturated", "flushed", "subnormal")
    layers = {
        "fc/input": dict(zip(names, (3.0, 100.0, 0.0, 0.1, 0.2))),
        "fc/weight": dict(zip(names, (0.5, 2000.0, 0.3, 0.0, 0.0))),
        "fc/grad_output": dict(zip(names, (1e-4, 1e8, 0.0, 0.4, 0.5))),
    }
    for rank in (0, 1):
        with open(run_dir / "metrics" / f"rank{rank}.jsonl", "w") as f:
            for step in range(8):
                row = {"rank": rank, "step": step, "scale": 1.0, "skipped": step == 2,
                       "growths": 0, "backoffs": 0, "clean_steps": step, "grad_norm": 1.0 + step,
                       "grad_norm_scaled": 1.0 + step, "loss": 5.0 - step * 0.1,
                       "loss_scaling": False}  # fmt: skip
                if step == 4:
                    row["resumed"] = True
                f.write(json.dumps(row) + "\n")
        with open(run_dir / "metrics" / f"fp8-rank{rank}.jsonl", "w") as f:
            for step in (0, 4):
                f.write(json.dumps({"rank": rank, "step": step, "layers": layers}) + "\n")
    return layers


def test_an_fp8_runs_report_has_a_heatmap_per_share_and_the_amax_headroom(tmp_path) -> None:
    layers = _write_fp8_run(tmp_path)
    fig = figure(tmp_path)
    heat = {ax.get_ylabel(): ax for ax in fig.axes if ax.get_ylabel().startswith("FP8")}
    assert list(heat) == [
        "FP8 flushed\nto zero (share)",
        "FP8 subnormal\n(share)",
        "FP8 saturated\n(share)",
        "FP8 amax headroom\n(binades)",
    ]
    keys = sorted(layers)
    fmt = {"fc/input": torch.float8_e4m3fn, "fc/weight": torch.float8_e4m3fn,
           "fc/grad_output": torch.float8_e5m2}  # fmt: skip
    for label, ax in heat.items():
        (mesh,) = [c for c in ax.collections if isinstance(c, matplotlib.collections.QuadMesh)]
        drawn = mesh.get_array().reshape(len(keys), 2).tolist()
        if "headroom" in label:  # the oracle: torch's own float8 maxima
            want = [math.log2(torch.finfo(fmt[k]).max / (layers[k]["amax"] * layers[k]["scale"]))
                    for k in keys]  # fmt: skip
        else:
            share = label.split()[1]
            want = [layers[k][share] for k in keys]
        assert [row[0] for row in drawn] == pytest.approx(want), label
        # The resume at step 4 is marked on every panel, heatmaps included.
        assert any(list(ln.get_xdata()) == [4, 4] for ln in ax.get_lines()), label
    assert "scale" not in [ax.get_ylabel().split("\n")[0] for ax in fig.axes][1]
    only = figure(tmp_path, fp8=["saturated"])
    assert [ax.get_ylabel() for ax in only.axes if ax.get_ylabel().startswith("FP8")] == [
        "FP8 saturated\n(share)"
    ]
    with pytest.raises(ValueError, match="overflowed"):
        figure(tmp_path, fp8=["overflowed"])
