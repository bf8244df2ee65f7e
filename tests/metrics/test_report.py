"""MetricsLog writes one JSON line per step; python -m dscale.report renders them to a PNG."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import dscale
from dscale.metrics import MetricsLog
from dscale.report import figure, main, read_metrics_log, read_resumes, render
from dscale.stats import track_numerics

pytestmark = pytest.mark.filterwarnings("ignore:dscale.GradScaler. the loss's autograd graph")


def _run(run_dir, steps: int, overflow_at: set[int], every: int) -> MetricsLog:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = dscale.GradScaler(device="cpu", init_scale=4.0, growth_interval=2)
    stats = track_numerics(scaler, model)
    log = MetricsLog(run_dir, stats=stats, rank=1, every=every)
    scaler.add_observer(log)
    for step in range(1, steps + 1):
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if step in overflow_at:
            model.weight.grad[0, 0] = float("nan")
        scaler.step(opt)
        scaler.update()
    return log


def test_the_log_holds_every_step_once_the_last_block_is_closed(tmp_path) -> None:
    log = _run(tmp_path, steps=5, overflow_at={3}, every=2)
    lines = (tmp_path / "metrics" / "rank1.jsonl").read_text().splitlines()
    assert len(lines) == 4  # two full blocks of 2; step 5 still buffered on the device
    log.close()
    rows = read_metrics_log(tmp_path)[1]
    # init 4, grows after 2 clean steps, halves on the NaN at step 3, grows after steps 4-5.
    assert [r["scale"] for r in rows] == [4.0, 8.0, 4.0, 4.0, 8.0]
    assert [r["skipped"] for r in rows] == [False, False, True, False, False]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [(r["growths"], r["backoffs"], r["clean_steps"]) for r in rows] == [
        (0, 0, 1), (1, 0, 0), (1, 1, 0), (1, 1, 1), (2, 1, 0),
    ]  # fmt: skip
    assert rows[2]["grad_norm"] == rows[1]["grad_norm"]  # a skipped step keeps the last norm
    assert rows[0]["grad_norm"] == pytest.approx(3**0.5)  # weight grad [1, 1], bias grad 1
    assert all(json.loads(line)["rank"] == 1 for line in lines)


def test_report_renders_a_png_from_the_log(tmp_path) -> None:
    _run(tmp_path, steps=6, overflow_at={2, 5}, every=3)
    path = render(tmp_path)
    assert path == str(tmp_path / "metrics.png")
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_line_writes_where_asked(tmp_path) -> None:
    _run(tmp_path, steps=3, overflow_at=set(), every=1)
    out = tmp_path / "x.png"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    assert out.stat().st_size > 0


def test_a_run_dir_without_a_log_names_the_fix(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dscale.report", str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "has no metrics log" in proc.stderr
    assert "MetricsLog" in proc.stderr


def test_every_must_be_positive(tmp_path) -> None:
    with pytest.raises(ValueError, match="every must be an int >= 1, got 0"):
        MetricsLog(tmp_path, every=0)


def _two_ranks_with_a_loss(run_dir) -> None:
    for rank in (0, 1):  # the ranks agree on the scale, so their scale lines coincide
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = dscale.GradScaler(device="cpu", init_scale=4.0, growth_interval=3)
        log = MetricsLog(run_dir, stats=track_numerics(scaler, model), rank=rank, every=4)
        scaler.add_observer(log)
        for step in range(20):
            opt.zero_grad()
            loss = (model(torch.ones(1, 2)) - 1).pow(2).sum()
            scaler.scale(loss).backward()
            if step in (7, 13):
                model.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            log.log_loss(step, loss.item())
        log.close()


def test_report_has_a_loss_panel_and_tells_the_ranks_apart(tmp_path) -> None:
    _two_ranks_with_a_loss(tmp_path)
    text = (tmp_path / "metrics" / "loss-rank1.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["step"] for r in rows] == list(range(20)) and rows[0]["rank"] == 1
    fig = figure(tmp_path)
    labels = [ax.get_ylabel() for ax in fig.axes]
    # Old report: three panels (scale, skips, grad norm), no loss.
    assert labels[0].startswith("loss\n") and len(labels) == 4, labels
    loss_lines = fig.axes[0].get_lines()
    assert len(loss_lines[0].get_xdata()) == 20
    for ax in fig.axes:  # every panel: rank 1's thinner dashes drawn over rank 0's line
        r0, r1 = ax.get_lines()[:2]
        assert (r0.get_label(), r1.get_label()) == ("rank 0", "rank 1")
        assert r0.get_linestyle() != r1.get_linestyle()
        assert r0.get_linewidth() > r1.get_linewidth()
        assert r0.get_zorder() < r1.get_zorder()
    assert "2 skipped, scale 4" in fig.texts[0].get_text()  # the headline a bug report quotes
    path = render(tmp_path, tmp_path / "report.png")
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path


def test_a_run_without_a_loss_log_has_no_loss_panel(tmp_path) -> None:
    _run(tmp_path, steps=4, overflow_at={2}, every=2).close()
    fig = figure(tmp_path)
    assert [ax.get_ylabel().split("\n")[0] for ax in fig.axes] == [
        "loss scale", "skipped steps", "grad norm",
    ]  # fmt: skip


def _attempt(run_dir, steps: range, overflow_at: set[int], state=None, keep_at=None):
    """Steps ``steps`` (0-based), the loss noted each step; one MetricsLog, as one attempt has.

    Returns the scaler's state dict after ``keep_at`` steps (a checkpoint), if asked.
    """
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = dscale.GradScaler(device="cpu", init_scale=4.0, growth_interval=100)
    if state is not None:
        scaler.load_state_dict(state)
    log = MetricsLog(run_dir, rank=0, every=4)
    scaler.add_observer(log)
    kept = None
    for step in steps:
        opt.zero_grad()
        loss = model(torch.full((1, 2), float(step))).sum()
        log.note_loss(loss)
        scaler.scale(loss).backward()
        if step in overflow_at:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        if step + 1 == keep_at:
            kept = scaler.state_dict()
    log.close()
    return kept


def test_the_report_draws_the_loss_of_every_step_with_skip_and_resume_marks(tmp_path) -> None:
    # Attempt 0 runs steps 0..7 and stops; attempt 1 resumes from the checkpoint after step 4.
    checkpoint = _attempt(tmp_path, range(8), overflow_at={2}, keep_at=5)
    _attempt(tmp_path, range(5, 10), overflow_at={7}, state=checkpoint)
    rows = read_metrics_log(tmp_path)[0]
    assert [r["step"] for r in rows] == list(range(10))  # the resumed rows replace steps 5..7
    assert all(isinstance(r["loss"], float) for r in rows)  # old code: no loss column
    assert read_resumes(tmp_path) == [5]
    fig = figure(tmp_path)
    ax_loss = fig.axes[0]
    assert list(ax_loss.get_lines()[0].get_xdata()) == list(range(10))  # every step
    marked = {float(p[0]) for c in ax_loss.collections for p in c.get_offsets()}
    assert marked == {2.0, 7.0}  # the skipped steps, on the loss panel
    assert any(list(ln.get_xdata()) == [5, 5] for ln in ax_loss.get_lines()), "no resume mark"


def test_the_step_axis_says_it_counts_from_0(tmp_path) -> None:
    """The log's steps are the scaler's 0-based iterations, while the launcher prints steps from 1:
    a run whose launcher said `step 10 skipped` has its x at 9. The axis says so, or a reader of
    the README's faults run looks for the skips one step off."""
    log = _run(tmp_path, steps=4, overflow_at={2}, every=1)
    log.close()
    skipped = [r["step"] for r in read_metrics_log(tmp_path)[1] if r["skipped"]]
    assert skipped == [1]  # the 2nd step, logged as 1
    label = figure(tmp_path).axes[-1].get_xlabel()
    assert "from 0" in label and "step N is at N-1" in label, label
